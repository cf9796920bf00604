"""Test image builders (import as ``ocibuild``): layer tars, OCI layouts and docker archives
written by hand, and real images built by third-party tools (umoci, skopeo).

Hand-written images are for exact control (bad input, every tar entry type, compression):

    layer = make_layer_tar([TarEntry("etc/hello", data=b"hi\\n"), whiteout("old")])
    digest = write_oci_layout(tmp / "img", [layer], tag="v1")

Third-party images check that we read what the real tools write:

    build_with_umoci(tmp / "img", "v1", [tree1, tree2])   # each tree is the full rootfs state
    to_docker_archive(tmp / "img", "v1", tmp / "img.tar")
    push_to_registry(tmp / "img", "v1", registry.host, "team/app")

Everything here is deterministic for the same input (fixed mtimes, gzip header without time).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = OCI_LAYER + "+gzip"
OCI_LAYER_ZSTD = OCI_LAYER + "+zstd"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar"
DOCKER_LAYER_GZIP = DOCKER_LAYER + ".gzip"
REF_NAME = "org.opencontainers.image.ref.name"

# A fixed, arbitrary timestamp (2023-11-14) so layers are reproducible.
DEFAULT_MTIME = 1_700_000_000


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --- layer tars ------------------------------------------------------------------------------

_TYPES = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "char": tarfile.CHRTYPE,
    "block": tarfile.BLKTYPE,
    "fifo": tarfile.FIFOTYPE,
}


@dataclass
class TarEntry:
    """One tar member. ``path`` is written exactly as given (``../x`` and ``/abs`` included).

    ``type`` is one of file, dir, symlink, hardlink, char, block, fifo. ``mode`` holds the
    permission bits including setuid (0o4000), setgid (0o2000) and sticky (0o1000); the
    default is 0o755 for dirs and 0o644 otherwise. ``link`` is the target of a symlink or
    hard link. ``xattrs`` are written as PAX ``SCHILY.xattr.<name>`` records.
    """

    path: str
    type: str = "file"
    data: bytes = b""
    mode: int | None = None
    uid: int = 0
    gid: int = 0
    uname: str = ""
    gname: str = ""
    mtime: int = DEFAULT_MTIME
    link: str = ""
    devmajor: int = 0
    devminor: int = 0
    xattrs: dict[str, bytes | str] = field(default_factory=dict)
    pax: dict[str, str] = field(default_factory=dict)  # extra raw PAX records


def whiteout(path: str, **kw: object) -> TarEntry:
    """An entry that deletes ``path`` from lower layers (``dir/.wh.name``)."""
    head, _, name = path.rstrip("/").rpartition("/")
    return TarEntry(f"{head}/.wh.{name}" if head else f".wh.{name}", **kw)  # type: ignore[arg-type]


def opaque(directory: str, **kw: object) -> TarEntry:
    """An entry that hides everything lower layers put in ``directory``."""
    d = directory.strip("/")
    return TarEntry(f"{d}/.wh..wh..opq" if d else ".wh..wh..opq", **kw)  # type: ignore[arg-type]


def make_tar(entries: Iterable[TarEntry]) -> bytes:
    """An uncompressed PAX tar of ``entries``, in the order given."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            if e.type not in _TYPES:
                raise ValueError(f"unknown tar entry type {e.type!r}")
            info = tarfile.TarInfo(e.path)
            info.type = _TYPES[e.type]
            info.mode = e.mode if e.mode is not None else (0o755 if e.type == "dir" else 0o644)
            info.uid, info.gid = e.uid, e.gid
            info.uname, info.gname = e.uname, e.gname
            info.mtime = e.mtime
            info.linkname = e.link
            info.devmajor, info.devminor = e.devmajor, e.devminor
            pax = dict(e.pax)
            for k, v in e.xattrs.items():
                # tarfile encodes PAX values as UTF-8 (surrogateescape keeps raw bytes).
                pax["SCHILY.xattr." + k] = (
                    v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else v
                )
            info.pax_headers = pax
            if e.type == "file":
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
            else:
                info.size = 0
                tar.addfile(info)
    return buf.getvalue()


def compress(data: bytes, compression: str | None) -> bytes:
    """``data`` compressed with "gzip", "zstd" or None (as is)."""
    if compression is None:
        return data
    if compression == "gzip":
        return gzip.compress(data, mtime=0)
    if compression == "zstd":
        return zstandard.ZstdCompressor(level=3).compress(data)
    raise ValueError(f"unknown compression {compression!r}")


def make_layer_tar(entries: Iterable[TarEntry], compression: str | None = "gzip") -> bytes:
    """A layer blob: the tar of ``entries``, compressed with gzip (default), zstd or None."""
    return compress(make_tar(entries), compression)


def decompress(blob: bytes) -> bytes:
    """The uncompressed tar of a layer blob (compression found from its magic bytes)."""
    if blob[:2] == b"\x1f\x8b":
        return gzip.decompress(blob)
    if blob[:4] == b"\x28\xb5\x2f\xfd":
        return zstandard.ZstdDecompressor().decompressobj().decompress(blob)
    return blob


def layer_media_type(blob: bytes) -> str:
    """The OCI layer media type that matches a blob's compression."""
    if blob[:2] == b"\x1f\x8b":
        return OCI_LAYER_GZIP
    if blob[:4] == b"\x28\xb5\x2f\xfd":
        return OCI_LAYER_ZSTD
    return OCI_LAYER


def diff_id(blob: bytes) -> str:
    return sha256(decompress(blob))


# --- OCI layouts by hand ---------------------------------------------------------------------


def canonical_json(doc: object) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def write_blob(layout: Path, data: bytes) -> dict:
    """Store ``data`` under ``blobs/sha256/``; returns a descriptor (digest, size)."""
    digest = sha256(data)
    p = blob_path(layout, digest)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return {"digest": digest, "size": len(data)}


def blob_path(layout: Path, digest: str) -> Path:
    algo, _, hexpart = digest.partition(":")
    return Path(layout) / "blobs" / algo / hexpart


def init_layout(layout: Path) -> None:
    """An empty OCI layout (kept as is if one is already there)."""
    layout = Path(layout)
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    if not (layout / "oci-layout").exists():
        (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    if not (layout / "index.json").exists():
        _write_index(layout, [])


def default_config(
    layers: Sequence[bytes], platform: str = "linux/amd64", **config: object
) -> dict:
    """An image config whose diff_ids match ``layers``; ``config`` fills its "config"."""
    os_, arch, *variant = platform.split("/")
    doc: dict = {
        "architecture": arch,
        "os": os_,
        "config": dict(config),
        "rootfs": {"type": "layers", "diff_ids": [diff_id(b) for b in layers]},
        "history": [{"created_by": f"ocibuild layer {i}"} for i in range(len(layers))],
    }
    if variant:
        doc["variant"] = variant[0]
    return doc


def add_image(
    layout: Path,
    layers: Sequence[bytes],
    config: dict | None = None,
    media_types: Sequence[str] | None = None,
    *,
    docker: bool = False,
    platform: str = "linux/amd64",
) -> dict:
    """Write an image's blobs and manifest into ``layout`` (index.json untouched).

    ``config`` defaults to ``default_config(layers, platform)``; a config without "rootfs"
    gets matching diff_ids. ``media_types`` overrides each layer's media type (default from
    its magic bytes). ``docker=True`` writes Docker schema2 media types. Returns the
    manifest's descriptor, with a "platform" taken from the config.
    """
    layout = Path(layout)
    init_layout(layout)
    if config is None:
        config = default_config(layers, platform)
    elif "rootfs" not in config:
        config = {**config, "rootfs": {"type": "layers", "diff_ids": [diff_id(b) for b in layers]}}
    if media_types is None:
        media_types = [layer_media_type(b) for b in layers]
        if docker:
            media_types = [
                {OCI_LAYER_GZIP: DOCKER_LAYER_GZIP, OCI_LAYER: DOCKER_LAYER}.get(m, m)
                for m in media_types
            ]
    layer_descs = [
        {"mediaType": mt, **write_blob(layout, b)}
        for b, mt in zip(layers, media_types, strict=True)
    ]
    config_desc = {"mediaType": DOCKER_CONFIG if docker else OCI_CONFIG}
    config_desc.update(write_blob(layout, canonical_json(config)))
    manifest = {
        "schemaVersion": 2,
        "mediaType": DOCKER_MANIFEST if docker else OCI_MANIFEST,
        "config": config_desc,
        "layers": layer_descs,
    }
    desc = {"mediaType": manifest["mediaType"], **write_blob(layout, canonical_json(manifest))}
    plat = {"architecture": config.get("architecture"), "os": config.get("os")}
    if config.get("variant"):
        plat["variant"] = config["variant"]
    desc["platform"] = plat
    return desc


def add_index(layout: Path, manifests: Sequence[dict], *, docker: bool = False) -> dict:
    """Write an image index (or Docker manifest list) over ``manifests`` (descriptors from
    ``add_image``); returns its descriptor."""
    media_type = DOCKER_LIST if docker else OCI_INDEX
    doc = {"schemaVersion": 2, "mediaType": media_type, "manifests": list(manifests)}
    return {"mediaType": media_type, **write_blob(Path(layout), canonical_json(doc))}


def tag_descriptor(layout: Path, desc: dict, tag: str | None) -> None:
    """Add ``desc`` to index.json under ``tag`` (replacing an entry with that tag)."""
    layout = Path(layout)
    init_layout(layout)
    entries = json.loads((layout / "index.json").read_text())["manifests"]
    entry = {k: v for k, v in desc.items() if k in ("mediaType", "digest", "size")}
    if tag is not None:
        entries = [e for e in entries if e.get("annotations", {}).get(REF_NAME) != tag]
        entry["annotations"] = {REF_NAME: tag}
    entries.append(entry)
    _write_index(layout, entries)


def _write_index(layout: Path, entries: list[dict]) -> None:
    doc = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}
    (Path(layout) / "index.json").write_bytes(canonical_json(doc))


def write_oci_layout(
    path: Path,
    layers: list[bytes],
    config: dict | None = None,
    tag: str | None = "latest",
    media_types: Sequence[str] | None = None,
    *,
    docker: bool = False,
) -> str:
    """Add one image to the OCI layout at ``path`` (created if needed) under ``tag``; returns
    the manifest digest. Layers are stored exactly as given, so a test can pass a corrupt one;
    see ``add_image`` for ``config``/``media_types``/``docker``."""
    desc = add_image(path, layers, config, media_types, docker=docker)
    tag_descriptor(path, desc, tag)
    return desc["digest"]


def write_multiplatform_layout(
    path: Path, images: dict[str, list[bytes]], tag: str | None = "latest", *, docker=False
) -> str:
    """An image index with one image per platform ("os/arch[/variant]" -> layers); returns
    the index digest."""
    descs = [
        add_image(path, layers, docker=docker, platform=plat) for plat, layers in images.items()
    ]
    index = add_index(path, descs, docker=docker)
    tag_descriptor(path, index, tag)
    return index["digest"]


def read_blob(layout: Path, digest: str) -> bytes:
    return blob_path(layout, digest).read_bytes()


def layer_blobs(layout: Path, tag: str) -> list[bytes]:
    """The layer blobs of the image ``tag`` of an OCI layout, bottom first."""
    entries = json.loads((Path(layout) / "index.json").read_text())["manifests"]
    (entry,) = [e for e in entries if e.get("annotations", {}).get(REF_NAME) == tag]
    return [read_blob(layout, d["digest"]) for d in manifest_of(layout, entry["digest"])["layers"]]


def manifest_of(layout: Path, digest: str) -> dict:
    return json.loads(read_blob(layout, digest))


# --- docker-archive by hand --------------------------------------------------------------------


def write_docker_archive(
    out_tar: Path,
    layers: Sequence[bytes],
    config: dict | None = None,
    repo_tags: Sequence[str] = ("example.test/app:latest",),
    *,
    form: str = "legacy",
) -> None:
    """A ``docker save`` tarball of one image.

    form="legacy": ``<id>/layer.tar``, ``<id>/VERSION``, ``<id>/json``, ``<config-hex>.json``
    (docker < 25). form="oci": docker >= 25: an OCI layout (``oci-layout``, ``index.json``,
    ``blobs/sha256/...``) plus manifest.json whose Layers name the blobs, and LayerSources.
    Layers are stored as given (docker saves them uncompressed).
    """
    if config is None:
        config = default_config(layers)
    config_bytes = canonical_json(config)
    config_hex = sha256(config_bytes).split(":")[1]
    files: dict[str, bytes] = {}
    if form == "legacy":
        names = []
        parent = ""
        for blob in layers:
            layer_id = hashlib.sha256((parent + sha256(blob)).encode()).hexdigest()
            files[f"{layer_id}/VERSION"] = b"1.0"
            files[f"{layer_id}/json"] = canonical_json({"id": layer_id, "parent": parent or None})
            files[f"{layer_id}/layer.tar"] = blob
            names.append(f"{layer_id}/layer.tar")
            parent = layer_id
        files[f"{config_hex}.json"] = config_bytes
        manifest = [{"Config": f"{config_hex}.json", "RepoTags": list(repo_tags), "Layers": names}]
    elif form == "oci":
        layout_files: dict[str, bytes] = {}
        mts = [
            DOCKER_LAYER if layer_media_type(b) == OCI_LAYER else layer_media_type(b)
            for b in layers
        ]
        descs = []
        for blob, mt in zip(layers, mts, strict=True):
            d = sha256(blob)
            layout_files[f"blobs/sha256/{d.split(':')[1]}"] = blob
            descs.append({"mediaType": mt, "digest": d, "size": len(blob)})
        layout_files[f"blobs/sha256/{config_hex}"] = config_bytes
        oci_manifest = canonical_json(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {
                    "mediaType": OCI_CONFIG,
                    "digest": "sha256:" + config_hex,
                    "size": len(config_bytes),
                },
                "layers": descs,
            }
        )
        mdigest = sha256(oci_manifest)
        layout_files[f"blobs/sha256/{mdigest.split(':')[1]}"] = oci_manifest
        layout_files["oci-layout"] = b'{"imageLayoutVersion":"1.0.0"}'
        layout_files["index.json"] = canonical_json(
            {
                "schemaVersion": 2,
                "mediaType": OCI_INDEX,
                "manifests": [
                    {
                        "mediaType": OCI_MANIFEST,
                        "digest": mdigest,
                        "size": len(oci_manifest),
                        "annotations": {REF_NAME: repo_tags[0].rpartition(":")[2]}
                        if repo_tags
                        else {},
                    }
                ],
            }
        )
        files.update(layout_files)
        manifest = [
            {
                "Config": f"blobs/sha256/{config_hex}",
                "RepoTags": list(repo_tags),
                "Layers": [f"blobs/sha256/{d['digest'].split(':')[1]}" for d in descs],
                "LayerSources": {d["digest"]: d for d in descs},
            }
        ]
    else:
        raise ValueError(f"unknown docker-archive form {form!r}")
    files["manifest.json"] = canonical_json(manifest)
    with tarfile.open(out_tar, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = DEFAULT_MTIME
            tar.addfile(info, io.BytesIO(data))


# --- real images from third-party tools --------------------------------------------------------


def _run(*args: str | os.PathLike) -> subprocess.CompletedProcess:
    cmd = [str(a) for a in args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _umoci(*args: str | os.PathLike) -> None:
    extra = [] if os.geteuid() == 0 else ["--rootless"]
    sub, *rest = args
    if sub in ("unpack", "repack") and extra:
        _run("umoci", sub, *extra, *rest)
    else:
        _run("umoci", sub, *rest)


def _sync_tree(src: Path, dest: Path) -> None:
    """Make ``dest`` hold exactly ``src``: everything not a directory is removed and copied
    again with ``cp -a`` (metadata preserved, so unchanged files produce no diff); directories
    missing from ``src`` are removed, so umoci records whiteouts for them."""
    for root, dirs, files in os.walk(dest, topdown=True):
        rel = Path(root).relative_to(dest)
        for name in files:
            os.unlink(os.path.join(root, name))
        keep = []
        for name in dirs:
            full = os.path.join(root, name)
            s = src / rel / name
            if os.path.islink(full):
                os.unlink(full)
            elif s.is_dir() and not s.is_symlink():
                keep.append(name)
            else:
                shutil.rmtree(full)
        dirs[:] = keep
    _run("cp", "-a", "--no-target-directory", src, dest)


def build_with_umoci(
    path: Path,
    tag: str,
    layer_dirs: Sequence[Path],
    *,
    entrypoint: Sequence[str] | None = None,
    cmd: Sequence[str] | None = None,
    env: Sequence[str] = (),
    user: str | None = None,
    workdir: str | None = None,
    architecture: str | None = None,
    base: str | None = None,
) -> None:
    """A multi-layer image built by umoci. Each of ``layer_dirs`` is the *full* root tree
    after that layer: what is new or changed becomes the layer, and what disappeared since
    the previous one becomes a whiteout (umoci computes the diff, gzip-compressed). With
    ``base`` (a tag of the same layout) the layers go on top of that image's, which the two
    images then share (the same layer blobs)."""
    path = Path(path)
    if not (path / "oci-layout").exists():
        _umoci("init", "--layout", path)
    if base is None:
        _umoci("new", "--image", f"{path}:{tag}")
    else:
        _umoci("tag", "--image", f"{path}:{base}", tag)
    bundle = path.parent / f".{path.name}.{tag}.bundle"
    for d in layer_dirs:
        if bundle.exists():
            shutil.rmtree(bundle)
        _umoci("unpack", "--image", f"{path}:{tag}", bundle)
        _sync_tree(Path(d), bundle / "rootfs")
        _umoci("repack", "--image", f"{path}:{tag}", bundle)
    if bundle.exists():
        shutil.rmtree(bundle)
    args: list[str] = []
    for e in entrypoint or ():
        args += ["--config.entrypoint", e]
    for c in cmd or ():
        args += ["--config.cmd", c]
    for e in env:
        args += ["--config.env", e]
    if user is not None:
        args += ["--config.user", user]
    if workdir is not None:
        args += ["--config.workingdir", workdir]
    if architecture is not None:
        args += ["--architecture", architecture]
    if args:
        _umoci("config", "--image", f"{path}:{tag}", *args)
    _umoci("gc", "--layout", path)


def index_of_tags(path: Path, images: dict[str, str], tag: str) -> str:
    """Tag ``tag`` in the layout at ``path`` as an OCI image index over images already
    there ("os/arch[/variant]" -> their tag, e.g. built by ``build_with_umoci`` with
    ``architecture``), each entry with its platform; returns the index digest."""
    path = Path(path)
    entries = json.loads((path / "index.json").read_text())["manifests"]
    by_tag = {e.get("annotations", {}).get(REF_NAME): e for e in entries}
    descs = []
    for plat, image_tag in images.items():
        os_, arch, *variant = plat.split("/")
        desc = {k: v for k, v in by_tag[image_tag].items() if k != "annotations"}
        desc["platform"] = {
            "os": os_,
            "architecture": arch,
            **({"variant": variant[0]} if variant else {}),
        }
        descs.append(desc)
    index = add_index(path, descs)
    tag_descriptor(path, index, tag)
    return index["digest"]


def unpack_with_umoci(oci_path: Path, tag: str, dest: Path) -> Path:
    """Unpack an image with umoci into the bundle ``dest`` (must not exist); returns its
    rootfs directory."""
    _umoci("unpack", "--image", f"{oci_path}:{tag}", dest)
    return Path(dest) / "rootfs"


def to_docker_archive(oci_path: Path, tag: str, out_tar: Path, ref: str | None = None) -> None:
    """``skopeo copy`` an OCI layout image to a docker-archive tarball (RepoTags ``ref``,
    default ``example.test/<layout name>:<tag>``)."""
    ref = ref or f"example.test/{Path(oci_path).name.lower()}:{tag}"
    Path(out_tar).unlink(missing_ok=True)
    _run(
        "skopeo",
        "--insecure-policy",
        "copy",
        "-q",
        f"oci:{oci_path}:{tag}",
        f"docker-archive:{out_tar}:{ref}",
    )


def push_to_registry(
    oci_path: Path,
    tag: str,
    host: str,
    repo: str,
    dest_tag: str | None = None,
    *,
    all_platforms: bool = False,
) -> None:
    """``skopeo copy`` an OCI layout image to ``docker://host/repo:tag`` over plain HTTP."""
    args = ["--all"] if all_platforms else []
    _run(
        "skopeo",
        "--insecure-policy",
        "copy",
        "-q",
        "--dest-tls-verify=false",
        *args,
        f"oci:{oci_path}:{tag}",
        f"docker://{host}/{repo}:{dest_tag or tag}",
    )


def tree_listing(root: Path) -> dict[str, tuple]:
    """path -> (kind, mode, uid, gid, size-or-target, content sha256 or None) for a tree; to
    compare trees without caring about inode numbers or timestamps."""
    out: dict[str, tuple] = {}
    root = Path(root)
    for dirpath, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            p = Path(dirpath) / name
            st = p.lstat()
            rel = p.relative_to(root).as_posix()
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("symlink", mode, st.st_uid, st.st_gid, os.readlink(p), None)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", mode, st.st_uid, st.st_gid, 0, None)
            elif stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
                out[rel] = ("file", mode, st.st_uid, st.st_gid, st.st_size, digest)
            else:
                out[rel] = ("special", st.st_mode, st.st_uid, st.st_gid, st.st_rdev, None)
    return out
