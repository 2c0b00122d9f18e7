"""Build of the asynchronous I/O extension (aio_csrc/ -> tiers._aio).

Everything else about the package lives in pyproject.toml; setuptools needs this
file only to describe the C extension. It links nothing but libc: io_uring is
driven with raw syscalls against <linux/io_uring.h>.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tiers._aio",
            sources=["aio_csrc/aio.c"],
            # aio.c #includes these; listing them makes build_ext rebuild when only a header changed.
            depends=["aio_csrc/ring.h", "aio_csrc/requests.h", "aio_csrc/engines.h", "aio_csrc/lifecycle.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            libraries=["pthread"],
        )
    ]
)
