"""The offline OCI layout builder: base layers kept, model in its own layer, deterministic."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from runtime.cli import main
from runtime.image import MT_MANIFEST, ImageSpec, Layer, build_layout

ROOT = Path(__file__).resolve().parents[2]


def _blob(layout: Path, digest: str) -> bytes:
    data = (layout / "blobs" / "sha256" / digest.split(":")[1]).read_bytes()
    assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
    return data


def _base_layout(root: Path) -> Path:
    """A one-layer base image, written by hand as an OCI layout."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("etc/os-release")
        data = b"ID=test\n"
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    layer = buf.getvalue()
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(b: bytes) -> str:
        d = hashlib.sha256(b).hexdigest()
        (blobs / d).write_bytes(b)
        return "sha256:" + d

    ld = put(layer)
    cfg = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/usr/bin", "A=1"]},
            "rootfs": {"type": "layers", "diff_ids": [ld]},
        }
    ).encode()
    cd = put(cfg)
    man = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MT_MANIFEST,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": cd,
                "size": len(cfg),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": ld,
                    "size": len(layer),
                }
            ],
        }
    ).encode()
    md = put(man)
    desc = {"mediaType": MT_MANIFEST, "digest": md, "size": len(man)}
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [desc]}))
    (root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    return root


def test_model_gets_its_own_layer(tiny_fp8: Path, tmp_path: Path) -> None:
    base = _base_layout(tmp_path / "base")
    spec = ImageSpec(
        layers=(Layer(tiny_fp8, "models/model"),),
        entrypoint=("runtime", "serve", "/models/model"),
        env=("A=2", "HF_HUB_OFFLINE=1"),
    )
    digest = build_layout(base, tmp_path / "out", spec)
    out = tmp_path / "out"
    index = json.loads((out / "index.json").read_text())
    assert index["manifests"][0]["digest"] == digest
    manifest = json.loads(_blob(out, digest))
    config = json.loads(_blob(out, manifest["config"]["digest"]))
    assert len(manifest["layers"]) == 2
    assert config["rootfs"]["diff_ids"][1] == manifest["layers"][1]["digest"]
    assert config["config"]["Entrypoint"] == ["runtime", "serve", "/models/model"]
    assert sorted(config["config"]["Env"]) == ["A=2", "HF_HUB_OFFLINE=1", "PATH=/usr/bin"]
    with tarfile.open(fileobj=io.BytesIO(_blob(out, manifest["layers"][1]["digest"]))) as tar:
        names = tar.getnames()
        assert "models/model/model.safetensors" in names and "models" in names
        member = tar.getmember("models/model/config.json")
        assert member.mtime == 0 and member.uid == 0
        assert tar.extractfile(member).read() == (tiny_fp8 / "config.json").read_bytes()
    # deterministic: the same inputs give the same manifest
    assert build_layout(base, tmp_path / "again", spec) == digest


def test_cli_build_image(tiny_fp8: Path, tmp_path: Path) -> None:
    base = _base_layout(tmp_path / "base")
    r = CliRunner().invoke(main, ["build-image", str(base), str(tiny_fp8), str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "o" / "index.json").exists()


@pytest.mark.integration
def test_build_script_converts_with_imagetool(tiny_fp8: Path, tmp_path: Path) -> None:
    base = _base_layout(tmp_path / "base")
    script = ROOT / "runtime" / "scripts" / "build-image.sh"
    dest = f"{tmp_path / 'store'}/runtime:v1"
    r = subprocess.run(
        ["bash", str(script), str(base), str(tiny_fp8), str(tmp_path / "out"), dest],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("sha256:")
    assert any((tmp_path / "store").rglob("*"))
