"""Fixtures for imagetool tests: a multi-layer source image built by umoci."""

from __future__ import annotations

import subprocess

import pytest
from itool import SourceImage, fill_base, fill_update
from ocibuild import build_with_umoci
from support import require, require_root, require_tool

from imagetool import format as format_module


@pytest.fixture(params=["compiled", "python"])
def codec(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test of sector decoding and hashing twice: through the compiled module
    (``imagetool._sectorcodec``, which CI builds) and through python-zstandard and
    python-xxhash alone, as where it is not built."""
    if request.param == "compiled":
        require(format_module._sectorcodec is not None,
                "imagetool._sectorcodec is not built (pip install -e . with gcc, libzstd-dev, "
                "libxxhash-dev)")  # fmt: skip
    else:
        monkeypatch.setattr(format_module, "_sectorcodec", None)
    return request.param


@pytest.fixture(scope="session")
def umoci_image(tmp_path_factory: pytest.TempPathFactory) -> SourceImage:
    """A three-layer image built by umoci from trees this fixture writes (needs root for
    device nodes and ownership)."""
    require_root()
    require_tool("umoci", "skopeo")
    base = tmp_path_factory.mktemp("tree")
    l1, l2 = base / "l1", base / "l2"
    fill_base(l1)
    subprocess.run(["cp", "-a", str(l1), str(l2)], check=True)
    fill_update(l2)
    l3 = base / "l3"
    subprocess.run(["cp", "-a", str(l2), str(l3)], check=True)
    (l3 / "app").mkdir()
    (l3 / "app/run.sh").write_text("#!/bin/sh\ncat /etc/hostname\n")
    layout = tmp_path_factory.mktemp("oci") / "image"
    build_with_umoci(
        layout, "v1", [l1, l2, l3],
        entrypoint=["/bin/sh"], cmd=["/app/run.sh"], env=["MODE=test"], user="0:0",
        workdir="/app",
    )  # fmt: skip
    return SourceImage(layout, "v1")
