"""Small helpers shared by the source tests (import as ``srcutil``)."""

from __future__ import annotations

import tarfile

from imagetool.sources import SourceImage


def read_layers(src: SourceImage) -> list[dict[str, bytes | None]]:
    """Each layer as {member name: content (None for non-files)}, read through open_layer."""
    out = []
    for layer in src.layers:
        with src.open_layer(layer) as f, tarfile.open(fileobj=f, mode="r|") as tar:
            members: dict[str, bytes | None] = {}
            for m in tar:
                if m.islnk():  # a hard link: its target's content (same layer)
                    data = members.get(m.linkname)
                else:
                    data = tar.extractfile(m).read() if m.isfile() else None
                members[m.name] = data
            out.append(members)
    return out


def flatten(layers: list[dict[str, bytes | None]]) -> dict[str, bytes | None]:
    """Apply layers (whiteouts, opaque dirs) to a {path: content} map: a test oracle."""
    tree: dict[str, bytes | None] = {}
    for members in layers:
        for name in members:
            path = name.removeprefix("./").rstrip("/")
            head, _, base = path.rpartition("/")
            prefix = head + "/" if head else ""
            if base == ".wh..wh..opq":
                for p in [p for p in tree if p.startswith(prefix) and p != head]:
                    del tree[p]
            elif base.startswith(".wh."):
                gone = prefix + base[4:]
                for p in [p for p in tree if p == gone or p.startswith(gone + "/")]:
                    del tree[p]
        for name, data in members.items():
            path = name.removeprefix("./").rstrip("/")
            if path in ("", ".") or path.rpartition("/")[2].startswith(".wh."):
                continue
            tree[path] = data
    return tree
