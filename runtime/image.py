"""Build the runtime image offline, as an OCI image layout, without a container daemon.

The image is a base image (an OCI layout already on disk, e.g. the CUDA + vLLM image of
``Containerfile``, exported once) plus layers appended here, each a directory put at a path
in the image: the runtime's environment, then the model weights in a layer of their own, so
a new model release changes one layer and the block image's weights stay contiguous.

Added layers are uncompressed, deterministic tars (sorted names, mtime 0, root-owned, no
user/group names), so the same inputs give the same digests. The result is converted to a
block image by ``imagetool convert`` (see ``runtime/scripts/build-image.sh``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import RuntimeToolError

log = logging.getLogger(__name__)

MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"


class ImageBuildError(RuntimeToolError, ValueError):
    """A base layout that cannot be read, or a layer source that does not exist."""


@dataclass(frozen=True)
class Layer:
    source: Path  # a directory on this machine
    dest: str  # its path in the image, e.g. "models/model"
    comment: str = ""


@dataclass(frozen=True)
class ImageSpec:
    layers: tuple[Layer, ...]
    entrypoint: tuple[str, ...] | None = None
    cmd: tuple[str, ...] | None = None
    env: tuple[str, ...] = ()  # "KEY=value", added to (or replacing) the base's
    exposed_ports: tuple[str, ...] = ()  # "8000/tcp"
    labels: dict[str, str] = field(default_factory=dict)
    ref_name: str = "latest"


def _sha256_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            n += len(chunk)
    return "sha256:" + h.hexdigest(), n


def _blob_path(layout: Path, digest: str) -> Path:
    algo, hexd = digest.split(":", 1)
    return layout / "blobs" / algo / hexd


def _read_json_blob(layout: Path, digest: str) -> dict:
    try:
        return json.loads(_blob_path(layout, digest).read_bytes())
    except (OSError, json.JSONDecodeError) as e:
        raise ImageBuildError(f"{layout}: blob {digest}: {e}") from None


def _put_blob(layout: Path, data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    p = _blob_path(layout, digest)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return digest, len(data)


def _base_manifest(layout: Path) -> dict:
    try:
        index = json.loads((layout / "index.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ImageBuildError(f"{layout}: not an OCI layout ({e})") from None
    desc = index["manifests"][0]
    while desc["mediaType"] in (MT_INDEX, DOCKER_LIST):
        sub = _read_json_blob(layout, desc["digest"])["manifests"]
        amd64 = [
            d for d in sub
            if d.get("platform", {}).get("os") == "linux"
            and d.get("platform", {}).get("architecture") == "amd64"
        ]  # fmt: skip
        desc = (amd64 or sub)[0]
    return _read_json_blob(layout, desc["digest"])


def write_layer_tar(layer: Layer, out: Path) -> None:
    """A deterministic tar of ``layer.source`` at ``layer.dest`` in the image."""
    src = Path(layer.source)
    if not src.is_dir():
        raise ImageBuildError(f"layer source {src} is not a directory")
    dest = layer.dest.strip("/")

    def norm(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime = 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        parts = dest.split("/")
        for i in range(1, len(parts)):  # parent directories
            d = tarfile.TarInfo("/".join(parts[:i]))
            d.type, d.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(norm(d))
        for root, dirs, files in os.walk(src):
            dirs.sort()
            rel = Path(root).relative_to(src)
            name = dest if rel == Path(".") else f"{dest}/{rel.as_posix()}"
            tar.add(root, arcname=name, recursive=False, filter=norm)
            for f in sorted(files):
                tar.add(Path(root) / f, arcname=f"{name}/{f}", recursive=False, filter=norm)


def build_layout(base: Path, out: Path, spec: ImageSpec) -> str:
    """Write ``out``: the base layout's image plus ``spec``'s layers; returns its digest."""
    base, out = Path(base), Path(out)
    manifest = _base_manifest(base)
    config = _read_json_blob(base, manifest["config"]["digest"])
    if out.exists():
        shutil.rmtree(out)
    (out / "blobs" / "sha256").mkdir(parents=True)
    (out / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    for desc in manifest["layers"]:  # base layers, unchanged
        src = _blob_path(base, desc["digest"])
        if not src.exists():
            raise ImageBuildError(f"{base}: missing layer blob {desc['digest']}")
        dst = _blob_path(out, desc["digest"])
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)

    layers = list(manifest["layers"])
    diff_ids = list(config.get("rootfs", {}).get("diff_ids", []))
    history = list(config.get("history", []))
    for layer in spec.layers:
        tmp = out / "layer.tmp"
        write_layer_tar(layer, tmp)
        digest, size = _sha256_file(tmp)
        tmp.rename(_blob_path(out, digest))
        layers.append({"mediaType": MT_LAYER_TAR, "digest": digest, "size": size})
        diff_ids.append(digest)  # uncompressed: the diff id is the blob digest
        history.append(
            {"created_by": f"lazyblock runtime image: {layer.dest}", "comment": layer.comment}
        )
        log.info("layer %s <- %s (%.1f MiB)", layer.dest, layer.source, size / 2**20)

    cc = dict(config.get("config") or {})
    env = {e.split("=", 1)[0]: e for e in cc.get("Env") or []}
    env.update({e.split("=", 1)[0]: e for e in spec.env})
    cc["Env"] = list(env.values())
    if spec.entrypoint is not None:
        cc["Entrypoint"] = list(spec.entrypoint)
        cc["Cmd"] = list(spec.cmd or [])
    elif spec.cmd is not None:
        cc["Cmd"] = list(spec.cmd)
    if spec.exposed_ports:
        cc["ExposedPorts"] = {
            **(cc.get("ExposedPorts") or {}),
            **{p: {} for p in spec.exposed_ports},
        }
    if spec.labels:
        cc["Labels"] = {**(cc.get("Labels") or {}), **spec.labels}
    new_config = dict(config, config=cc, rootfs={"type": "layers", "diff_ids": diff_ids})
    new_config["history"] = history
    new_config.pop("created", None)  # deterministic
    cfg_digest, cfg_size = _put_blob(out, json.dumps(new_config, sort_keys=True).encode())

    new_manifest = {
        "schemaVersion": 2,
        "mediaType": MT_MANIFEST,
        "config": {"mediaType": MT_CONFIG, "digest": cfg_digest, "size": cfg_size},
        "layers": layers,
    }
    m_digest, m_size = _put_blob(out, json.dumps(new_manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2,
        "mediaType": MT_INDEX,
        "manifests": [
            {
                "mediaType": MT_MANIFEST,
                "digest": m_digest,
                "size": m_size,
                "platform": {"os": "linux", "architecture": config.get("architecture", "amd64")},
                "annotations": {"org.opencontainers.image.ref.name": spec.ref_name},
            }
        ],
    }
    (out / "index.json").write_text(json.dumps(index, sort_keys=True))
    return m_digest
