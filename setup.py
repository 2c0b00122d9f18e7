"""Build of the two C extensions: asynchronous I/O (aio_csrc/ -> tiers._aio) and the host Adam
kernels, over compressed moments and the fused fp32 step (optim_csrc/ -> infinity.optim._qadam).

Everything else about the package lives in pyproject.toml; setuptools needs this
file only to describe the C extensions. They link nothing but libc (and libm): io_uring is
driven with raw syscalls against <linux/io_uring.h>; the Adam kernel is plain C that gcc
vectorizes, in versions for AVX-512, AVX2 and any x86-64 chosen when it loads.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tiers._aio",
            sources=["aio_csrc/aio.c"],
            # aio.c #includes these; listing them makes build_ext rebuild when only a header changed.
            depends=["aio_csrc/ring.h", "aio_csrc/requests.h", "aio_csrc/engines.h", "aio_csrc/lifecycle.h",
                     "aio_csrc/methods.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            libraries=["pthread"],
        ),
        Extension(
            "infinity.optim._qadam",
            sources=["optim_csrc/qadam.c"],
            depends=["optim_csrc/kernels.h"],
            # -ffp-contract=off: no fused multiply-adds but the ones written out (fmaf), so the codes
            # it writes equal the torch twin's (infinity/optim/moments.py), and the fused fp32 step
            # torch's kernel, bit for bit on every machine.
            extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno",
                                "-fno-trapping-math", "-Wall", "-Wextra",
                                "-Wno-unused-parameter"],
            libraries=["pthread", "m", "dl"],
        ),
    ]
)
