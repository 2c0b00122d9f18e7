#!/usr/bin/env bash
# The GPU checks of the data path in one command that fits a lent machine's 15 minutes of device time
# (its start takes 2-3 of them). Run from the repository root on the GPU machine:
#
#   bash benchmarks/gpu_session.sh [OUT_DIR]        (OUT_DIR defaults to $OUT, else ./out)
#
# 1. builds the C extensions in place (PYTHONPATH=. is the install);
# 2. tests/gpu: every preset against plain torch on CUDA, the ledger of a steady GPU step, and the
#    profiler's view (no pageable memcpy, no synchronize in forward/backward);
# 3. benchmarks/gpu.py at GPT 350M, bf16, batch 8 x 1024: plain torch and the presets, alternating;
# 4. when wheels are in .whl/ (benchmarks/gpu_wheels.sh downloads them; pass .whl in the call's
#    carry), DeepSpeed 0.19.8 is installed into /tmp/site and its ZeRO-2 / ZeRO-3 CPU-offload rows
#    run beside ours at the same size.
# 5. benchmarks/gpu_profile.py: one steady step at 350M per preset in PROFILE_CONFIGS (offload-host), forward/backward/step times
#    and the profiler's top operators.
# 6. PHASES="side-by-side" (everything below side by side in one 15-minute lease), in priority order, so that
#    a cut leaves the most important rows: build, the DeepSpeed install and its CPU Adam's build, then
#    offload13: GPT 1.3B, plain torch, offload-optimizer and offload-host, ZeRO-2 and ZeRO-3 CPU offload, then
#      the two presets with optimizer.update_in_backward=true (oo-uib, oh-uib) (gpu-1.3B-offload.json);
#    disk (the NVMe bandwidth, 2 GiB, one pass per setting), then
#    auto7: infinity.Init("auto") at GPT 6.7B beside the `device` preset at the largest size that fits the GPU
#      (DEVICE_SIZE: 4B where the GPU has over 100 GB, else 2.7B: 18 B/param of states and about 17 GB of
#      activations at 2 x 1024 tokens), batch 2 x 1024 (gpu-6.7B-auto.json). "auto" keeps a quarter of the
#      GPU for activations here (activations.checkpoint_nbytes unset: [Note: activations before the first
#      step]). DeepSpeed ZeRO-2 CPU offload at 6.7B (CONFIGS_AUTO7=...,ds-zero2@6.7B) is left out: it builds
#      27 GB of fp32 weights and pins about 16 B/param (107 GB of a 128 GiB host) before its first step, more
#      than this phase's time; it needs a lease of its own;
#    nvme13 with the bound: `nvme` at 1.3B, 3 steps, the NVMe bound max(torch's 1.3B step from offload13,
#      ledger bytes / disk.json's rates) in its own column (ZeRO-Infinity's row, whose async_io op is built at
#      its first use, only with NVME_DS=1).
#    Every gpu.py run there has --predict: the step infinity.plan predicts (phases, schedule, governing term,
#    on a machine profile probed once and cached, the disk rates from disk.json) beside the measured one.
#    Bounds (s): build 60, ds 45 + its CPU Adam 75, offload13 210, disk 40, auto7 120, nvme13 125; the
#    session's DEADLINE (570 s: one device command runs 600 s at most) cuts the last ones, nvme13 first, and a
#    phase with under 20 s left is skipped. gpu.py rewrites its JSON after every row, so a phase cut at its
#    bound keeps the rows it finished; each row's own --timeout is under its phase's bound. Call the device
#    with timeout_s=600. The environment: SIZE13, SIZE7, DEVICE_SIZE, BATCH (BATCH7
#    for auto7), SEQ, DTYPE, STEPS13, STEPS7, RUN_TIMEOUT13, RUN_TIMEOUT7, CONFIGS_OFFLOAD13, CONFIGS_AUTO7,
#    MACHINE (a profile file instead of the probe), DISK_SIZE, DISK_REPEATS, BOUND_OFFLOAD13, BOUND_AUTO7,
#    BOUND_DS_ADAM, NVME_DS, DEADLINE.
#    SIDE_BY_SIDE_PHASES narrows them. On a CPU machine SIDE_BY_SIDE_PHASES="offload13 disk auto7 nvme13"
#    SIZE13=tiny SIZE7=tiny DEVICE_SIZE=tiny BATCH=2 BATCH7=2 SEQ=16 DTYPE=float32 runs the same commands at a
#    tiny size (75-95 s on 2 cores); DRY_RUN=1 prints each phase's command and bound instead of running it
#    (tests/integration/test_benchmarks_gpu.py checks them).
# Each phase has its own time bound, so one that hangs leaves the others their time; what each
# printed is in OUT_DIR/log.txt under a line "===== PHASE", with the preamble (GPU, torch, where /tmp is, memory)
# and the machine profile the predictions used; the JSON files beside it. The environment narrows a session:
# PHASES (default "build tests ds bench profile"; "bench13" adds the benchmark at 1.3B (CONFIGS13), "adam" adds the host Adam benchmark, "nvme13" the NVMe rows at 1.3B
# beside ZeRO-Infinity and the disk's bandwidth ("disk" alone), "suite" the whole test suite), CONFIGS (the infinity rows of the benchmark; BENCH_ARGS can add --mode rows, e.g.
# "--mode oo-uib=offload-optimizer:optimizer.update_in_backward=true" with oo-uib in CONFIGS),
# PROFILE_CONFIGS, DIAG (a command run after the build), STEPS, REPEAT, RUN_TIMEOUT (seconds per benchmark run), NVME_CONFIGS,
# NVME_STEPS, RUN_TIMEOUT_NVME (the nvme13 rows), and BOUND_<PHASE> for each phase's bound.
set -uo pipefail
out=${1:-${OUT:-out}}
mkdir -p "$out"
# faulthandler: a process that aborts prints every Python thread's stack.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
# Every phase's output goes into one file, $out/log.txt, each under a header line: the lease brings back 8 files
# from $OUT at most, and one log each (11 files in a side-by-side session) would lose some of the JSON.
log=$out/log.txt
# The session ends by DEADLINE seconds (default 570: one device command runs 600 s at most, and one killed at
# that limit loses the phase under way): a phase runs to min(its bound, what is left), and one with under 20 s
# left is skipped, so the last phases are cut, not the command.
deadline=${DEADLINE:-570}
phase() {   # phase NAME SECONDS COMMAND...: run it bounded, keep its output, say how it ended; returns its status
  local name=$1 limit=$2; shift 2
  local left=$((deadline - SECONDS))
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then
    echo "== $name: skipped, $left s left of the session's $deadline s" | tee -a "$log"
    return 124
  fi
  if [[ -n ${DRY_RUN:-} ]]; then echo "== $name (bound $limit s): $*"; return 0; fi
  local t0=$SECONDS start
  echo "===== $name (bound $limit s): $*" >>"$log"
  start=$(stat -c %s "$log")
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1   # -k: a child that ignores SIGTERM is killed 10 s later
  local rc=$? part
  part=$(tail -c +"$((start + 1))" "$log" | tail -n 15)
  echo "== $name: exit $rc after $((SECONDS - t0)) s (bound $limit s)" | tee -a "$log"
  printf '%s\n' "$part"
  return $rc
}
if [[ -z ${DRY_RUN:-} ]]; then
  {
    echo "session deadline $deadline s"
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| storage lending:',
      hasattr(torch.UntypedStorage, '_swap_data_ptr_') and hasattr(torch._C, '_construct_storage_from_data_pointer'))"
    # where the swap files and the disk phase go: a tmpfs there would measure RAM, not a disk
    df -h "${TMPDIR:-/tmp}"; findmnt -T "${TMPDIR:-/tmp}" 2>/dev/null; free -g; nproc
  } 2>&1 | tee -a "$log"
fi
phases=" ${PHASES:-build tests ds bench profile} "
side_by_side=""
if [[ $phases == *" side-by-side "* ]]; then   # its phases, with its bounds unless BOUND_* says otherwise
  side_by_side=1 phases+="${SIDE_BY_SIDE_PHASES:-build ds offload13 disk auto7 nvme13} "
  : "${BOUND_BUILD:=60}" "${BOUND_DS:=45}" "${BOUND_DISK:=40}" "${BOUND_NVME13:=125}" "${NVME_STEPS:=3}"
  : "${RUN_TIMEOUT_NVME:=120}" "${NVME_CONFIGS:=nvme}" "${DISK_SIZE:=2GiB}" "${DISK_REPEATS:=1}"
  : "${BOUND_AUTO7:=120}" "${RUN_TIMEOUT7:=110}"
fi
want() { [[ $phases == *" $1 "* ]]; }
want build && phase build "${BOUND_BUILD:-120}" python3 setup.py build_ext --inplace -q
[[ -n ${DIAG:-} ]] && phase diag "${BOUND_DIAG:-60}" bash -c "$DIAG"
want tests && phase tests-gpu "${BOUND_TESTS:-180}" python3 -m pytest -q -p no:cacheprovider tests/gpu
# The whole suite on a GPU machine (issue 22: `make test` passes there as on a CPU machine; the tests choose
# their device, tests/conftest.py sets INFINITY_DEVICE=cpu). make test itself would create .venv and pip-install
# torch, which a machine without a package index cannot: this runs its pytest with the machine's torch. On 2
# cores the suite takes 11-13 minutes, so where pytest-xdist is installed (the CUDA image has it) it runs on
# SUITE_WORKERS processes (default 14) of OMP_NUM_THREADS=2 threads each, a CI machine's 2 cores apiece, and
# pytest-timeout stops a test that hangs after 140 s; tests/gpu runs in it too, as under `make test`. On the H200
# (16 cores, 2026-11-28) that took 226 s. Every failure and error is listed at the end of its part of log.txt.
suite_workers=()
python3 -c "import xdist" 2>/dev/null && suite_workers=(-n "${SUITE_WORKERS:-14}")
python3 -c "import pytest_timeout" 2>/dev/null && suite_workers+=(--timeout=140)
want suite && phase suite "${BOUND_SUITE:-300}" env OMP_NUM_THREADS=2 python3 -m pytest -q -rfE -p no:cacheprovider \
  "${suite_workers[@]}" --durations=10 tests
ds=""
if want ds && ls .whl/deepspeed-* >/dev/null 2>&1; then
  # DeepSpeed's async_io op (the ds-infinity rows) links -laio: without the machine's own, the .deb files
  # gpu_wheels.sh fetched are unpacked, and the compiler, DeepSpeed's check (CFLAGS, LDFLAGS) and the loader
  # are pointed at them.
  if [[ -z ${DRY_RUN:-} && ! -e /usr/include/libaio.h ]] && ls .whl/libaio*.deb >/dev/null 2>&1; then
    mkdir -p /tmp/libaio
    for deb in .whl/libaio*.deb; do   # dpkg-deb, or binutils' ar and tar where there is no dpkg
      dpkg-deb -x "$deb" /tmp/libaio 2>/dev/null ||
        (d=$(mktemp -d) && cd "$d" && ar x "$OLDPWD/$deb" && tar -xf data.tar.* -C /tmp/libaio)
    done
    inc=/tmp/libaio/usr/include lib=$(dirname "$(find /tmp/libaio -name 'libaio.so*' | head -n 1)")
    export CPATH=$inc${CPATH:+:$CPATH} LIBRARY_PATH=$lib${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} CFLAGS="-I$inc" LDFLAGS="-L$lib"
    echo "libaio unpacked from .whl/: $lib"
  fi
  if phase deepspeed-install "${BOUND_DS:-120}" env DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps \
      --no-build-isolation --target /tmp/site .whl/*.whl .whl/*.tar.gz; then
    export PYTHONPATH=$PYTHONPATH:/tmp/site
    ds=",ds-zero2,ds-zero3"
    # Under side-by-side DeepSpeed's CPU Adam is built here (DS_BUILD_OPS=0 builds it at first use, a minute or
    # more), so that no row's own timeout spends it.
    # A build cut at its bound leaves torch's extension lock behind, and each DeepSpeed row would then wait on
    # it until its own timeout: without a CPU Adam, no DeepSpeed rows.
    if [[ -n $side_by_side ]] && ! phase deepspeed-cpu-adam "${BOUND_DS_ADAM:-75}" python3 -c \
        "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"; then
      [[ -z ${DRY_RUN:-} ]] && rm -rf "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}"/*/cpu_adam
      ds=""
      echo "DeepSpeed's CPU Adam did not build: no DeepSpeed rows" | tee -a "$log"
    fi
  fi
fi
# The side-by-side rows (item 6 above). The sizes, batch and dtype are the environment's so that a CPU machine
# can run the same commands at a tiny size.
size13=${SIZE13:-1.3B} size7=${SIZE7:-6.7B} batch=${BATCH:-8} seq=${SEQ:-1024} dtype=${DTYPE:-bfloat16}
if [[ -z ${DEVICE_SIZE:-} ]]; then
  gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  DEVICE_SIZE=$([[ ${gpu_mib:-0} -gt 100000 ]] && echo 4B || echo 2.7B)
fi
predict=(--predict ${MACHINE:+--machine "$MACHINE"})
want offload13 && phase gpu-1.3B-offload "${BOUND_OFFLOAD13:-210}" python3 benchmarks/gpu.py --sizes "$size13" \
  --configs "${CONFIGS_OFFLOAD13:-torch,offload-optimizer,offload-host${ds},oo-uib,oh-uib}" --steps "${STEPS13:-4}" \
  --repeat 1 --batch "$batch" --seq "$seq" --dtype "$dtype" --timeout "${RUN_TIMEOUT13:-90}" \
  --mode oo-uib=offload-optimizer:optimizer.update_in_backward=true \
  --mode oh-uib=offload-host:optimizer.update_in_backward=true "${predict[@]}" --json "$out/gpu-1.3B-offload.json"
want bench && phase gpu-350M "${BOUND_BENCH:-420}" python3 benchmarks/gpu.py --sizes 350M \
  --configs "${CONFIGS:-torch,device,offload-optimizer,offload-host}$ds" --steps "${STEPS:-6}" --repeat "${REPEAT:-2}" \
  --batch 8 --seq 1024 --dtype bfloat16 --timeout "${RUN_TIMEOUT:-200}" --json "$out/gpu-350M.json" ${BENCH_ARGS:-}
# The same at GPT 1.3B (issue 22's second size), rows in CONFIGS13 (default plain torch and the `device` preset).
want bench13 && phase gpu-1.3B "${BOUND_BENCH13:-240}" python3 benchmarks/gpu.py --sizes 1.3B \
  --configs "${CONFIGS13:-torch,device}" --steps "${STEPS:-6}" --repeat 1 \
  --batch 8 --seq 1024 --dtype bfloat16 --timeout "${RUN_TIMEOUT:-200}" --json "$out/gpu-1.3B.json" ${BENCH_ARGS:-}
# Issue 23's GPU figure: GPT 1.3B with everything on NVMe (fp32 and int8 states) beside DeepSpeed ZeRO-Infinity
# (offload_param and offload_optimizer on nvme) on the machine's disk; each step is 20-30 s, so 4 steps a row (the
# s/step is the median of steps 2-4: step 2 also first-touches the update's host buffers where they are not pinned,
# 2.5x a steady step at 20M and 125M on a CPU machine, which a median of two would average in). DeepSpeed
# JIT-builds its async_io op first (238 s on 2 cores of a CPU machine with the unpacked libaio; its CPU Adam too).
# The bound is max(GPU compute, NVMe bytes / the disk's bandwidth): plain torch's row gives the first (in
# the same command), the disk's read and write bandwidth with the engine's own I/O (8 MiB blocks, where the
# swap directories go: the system temp dir) the second; the bytes are each row's ledger. 22 s on a CPU machine.
{ want disk || want nvme13; } && phase disk "${BOUND_DISK:-90}" python3 -m infinity.cli.bench nvme \
  --path "${TMPDIR:-/tmp}" --size "${DISK_SIZE:-4GiB}" --block-sizes 8MiB --queue-depths 32 --threads 4 --no-baselines \
  --no-progress --repeats "${DISK_REPEATS:-3}" --json "$out/disk.json"
# auto7 after the disk phase: its profile probe records disk.json's rates in the machine's cached profile, so
# that Init("auto") may choose NVMe where host memory is short.
want auto7 && phase gpu-6.7B-auto "${BOUND_AUTO7:-150}" python3 benchmarks/gpu.py --sizes "$size7" \
  --configs "${CONFIGS_AUTO7:-auto@$size7,device@$DEVICE_SIZE}" --steps "${STEPS7:-4}" \
  --repeat 1 --batch "${BATCH7:-2}" --seq "$seq" --dtype "$dtype" --timeout "${RUN_TIMEOUT7:-120}" "${predict[@]}" \
  --bench-json "$out/disk.json" --json "$out/gpu-6.7B-auto.json"
# Under side-by-side: no torch row (the bound's compute is offload13's torch step: --compute-json), the disk's
# rates from disk.json for the bound and the prediction.
nvme_predict=() nvme_ds=$ds
# ZeRO-Infinity's row builds DeepSpeed's async_io op at its first use and lays out its swap files: minutes,
# which a side-by-side session has not left (NVME_DS=1 keeps it).
[[ -n $side_by_side && -z ${NVME_DS:-} ]] && nvme_ds=""
[[ -n $side_by_side ]] && nvme_predict=("${predict[@]}" --bench-json "$out/disk.json" --compute-json "$out/gpu-1.3B-offload.json")
want nvme13 && phase gpu-1.3B-nvme "${BOUND_NVME13:-480}" python3 benchmarks/gpu.py --sizes "$size13" \
  --configs "${NVME_CONFIGS:-torch,nvme,nvme-int8}${nvme_ds:+,ds-infinity}" --steps "${NVME_STEPS:-4}" --repeat 1 \
  --batch "$batch" --seq "$seq" --dtype "$dtype" --timeout "${RUN_TIMEOUT_NVME:-240}" "${nvme_predict[@]}" \
  --json "$out/gpu-1.3B-nvme.json"
# The host Adam on this machine's cores: the engine step with bf16 compute copies by the C pass and by
# torch's kernel with two conversions (the update the offload presets' forward waits for), and with int8
# states (issue 23: at least fp32's rate; on 2 cores of a Zen 3 (AVX2) 0.90-1.0x, of a Zen 4 (AVX-512 block) 1.02-1.15x with
# bf16 compute). On the H100 box's 16-core Xeon (2026-11-28, a27579a, threads started per C call) the C pass
# took 0.275 s against torch's kernel's 0.176, int8 1.13x fp32 with bf16 compute: rerun since the kernels run on
# the calling thread's OpenMP team instead of threads started per call.
want adam && phase adam "${BOUND_ADAM:-150}" python3 benchmarks/adam.py --sizes 350M --repeats 3 --rounds 1 \
  --skip foreach,deepspeed --state-dtypes fp32,int8,bf16-compute,bf16-compute-torch,int8-bf16-compute --json "$out/adam-350M.json"
for config in ${PROFILE_CONFIGS:-offload-host}; do
  want profile && phase "profile-$config" "${BOUND_PROFILE:-90}" python3 benchmarks/gpu_profile.py --model-size 350M \
    --config "$config" --batch 8 --seq 1024 --dtype bfloat16
done
# The machine profile the --predict rows used (probed once here, cached), for reading the predictions later.
[[ -z ${DRY_RUN:-} && -e $HOME/.cache/infinity/machine.json ]] &&
  { echo "===== machine profile"; cat "$HOME/.cache/infinity/machine.json"; echo; } >>"$log"
# Each phase's own line says how it ended; the session ends 0 (a last phase left out is no failure).
exit 0
