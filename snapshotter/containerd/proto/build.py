"""Generate the Python gRPC stubs from this package's ``.proto`` files.

Run at install time (``scripts/install-deps`` runs ``python -m
snapshotter.containerd.proto.build``); the generated ``*_pb2*.py`` files are build outputs,
ignored by git, never edited. The ``.proto`` files import each other by their path from the
repository root (``snapshotter/containerd/proto/mount.proto``), so the generated modules
import each other as ``snapshotter.containerd.proto.<name>_pb2`` and no top-level
``containerd`` package is needed. The protobuf *package* names stay containerd's, which is
what the wire contract needs.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)

PROTO_DIR = Path(__file__).resolve().parent
# The directory that holds the ``snapshotter`` package: the proto import root.
SOURCE_ROOT = PROTO_DIR.parents[2]
PROTOS = (
    "mount.proto",
    "snapshots.proto",
    "cri.proto",
    "descriptor.proto",
    "images.proto",
    "content.proto",
    "leases.proto",
    "version.proto",
    "introspection.proto",
)


class StubBuildError(RuntimeError):
    """protoc failed or grpcio-tools is missing."""


def generated_paths() -> list[Path]:
    out = []
    for name in PROTOS:
        stem = name.removesuffix(".proto")
        out += [PROTO_DIR / f"{stem}_pb2.py", PROTO_DIR / f"{stem}_pb2_grpc.py"]
    return out


def up_to_date() -> bool:
    """Whether every stub exists and is newer than every ``.proto`` file."""
    newest_proto = max((PROTO_DIR / p).stat().st_mtime for p in PROTOS)
    return all(p.exists() and p.stat().st_mtime >= newest_proto for p in generated_paths())


def build() -> None:
    """Run protoc (from grpcio-tools) over the package's ``.proto`` files."""
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as e:
        raise StubBuildError("grpcio-tools is needed to generate the gRPC stubs") from e
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{SOURCE_ROOT}",
        f"-I{well_known}",
        f"--python_out={SOURCE_ROOT}",
        f"--pyi_out={SOURCE_ROOT}",
        f"--grpc_python_out={SOURCE_ROOT}",
        *(str(Path("snapshotter/containerd/proto") / p) for p in PROTOS),
    ]
    code = protoc.main(args)
    if code != 0:
        raise StubBuildError(f"protoc exited with {code}")
    log.info("generated gRPC stubs in %s", PROTO_DIR)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        build()
    except StubBuildError as e:
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
