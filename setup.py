"""The compiled modules of the package, each with a Python fallback that does the same work:

* ``imagetool._sectorcodec`` (see its source): a sector decoded and hashed in one pass;
  needs the headers of libzstd and libxxhash. Without it ``imagetool.format`` works
  through python-zstandard and python-xxhash.
* ``snapshotter.mount._fastreads`` (see its source): FUSE READs answered from sector memory
  and node cache entries without the interpreter; needs the headers of libxxhash. Without
  it ``snapshotter.mount.fusewire`` answers every request in Python.

Built where a C compiler and those headers are at hand (Debian's gcc, python3-dev,
libzstd-dev, libxxhash-dev: ``scripts/install-deps``); elsewhere the build goes on without
them. Everything else is in ``pyproject.toml``."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "imagetool._sectorcodec",
            ["imagetool/_sectorcodec.c"],
            libraries=["zstd", "xxhash"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
        Extension(
            "snapshotter.mount._fastreads",
            ["snapshotter/mount/_fastreads.c"],
            libraries=["xxhash"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
    ]
)
