#!/usr/bin/env bash
# Downloads what DeepSpeed 0.19.8 needs on a lent GPU machine (which reaches no package index) into
# .whl/, for benchmarks/gpu_session.sh: DeepSpeed's source distribution (built there with
# DS_BUILD_OPS=0; its CPU Adam JIT-builds at first use) and cp312 wheels of its pure dependencies; and,
# where apt can fetch them, the libaio runtime and headers as .deb files: ZeRO-Infinity's NVMe rows JIT-build
# DeepSpeed's async_io op, which links -laio, and gpu_session.sh unpacks them when the machine has none.
# Run here, from the repository root; .whl/ is ignored by git and travels as the device call's carry.
set -euo pipefail
mkdir -p .whl
python3 -m pip download -q --no-deps --no-binary :all: -d .whl deepspeed==0.19.8
for pkg in hjson pydantic pydantic-core annotated-types typing-inspection typing_extensions; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$pkg"
done
(cd .whl && apt-get download libaio1 libaio-dev >/dev/null 2>&1) ||
  echo "gpu_wheels.sh: apt-get download libaio1 libaio-dev failed: the ds-infinity rows need libaio on the GPU machine"
ls -la .whl
