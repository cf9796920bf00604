"""The one compiled module of the package (``imagetool._sectorcodec``, see its source): built
where a C compiler and the headers of libzstd and libxxhash are at hand (Debian's gcc,
python3-dev, libzstd-dev, libxxhash-dev: ``scripts/install-deps``). Elsewhere the build
goes on without it and ``imagetool.format`` does the same work through python-zstandard and
python-xxhash. Everything else is in ``pyproject.toml``."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "imagetool._sectorcodec",
            ["imagetool/_sectorcodec.c"],
            libraries=["zstd", "xxhash"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
