"""The import rules of the packages, checked on their source: every import, at module level
or inside a function, goes the one way the package docstrings say (``snapshotter/__init__``:
cli -> containerd -> mount -> datapath -> cache -> leaves; imagetool knows none of the
others; runtime reaches serving only through ``serving.wire``; ``lazyblock``, the edge they
share, imports none of them), and no module imports one
that imports it back, however indirectly."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lazyblock", "imagetool", "snapshotter", "serving", "runtime")

# snapshotter's rooms in their order: a module may import its own room and those after it.
ROOMS = (
    ("snapshotter.__main__", "snapshotter.cli"),
    ("snapshotter.prometheus",),
    ("snapshotter.containerd",),
    ("snapshotter.mount",),
    ("snapshotter.datapath",),
    ("snapshotter.cache",),
    ("snapshotter.errors", "snapshotter.metrics", "snapshotter.config", "snapshotter.systemd",
     "snapshotter.startup", "snapshotter"),
)  # fmt: skip
# What of imagetool the snapshotter may use: the formats both sides read or write (the block
# format; the startup profile, which the snapshotter writes and convert reads), errors, the
# stores and the registry client, platforms.
IMAGETOOL_FOR_SNAPSHOTTER = ("imagetool.format", "imagetool.profile", "imagetool.errors",
                             "imagetool.stores", "imagetool.registry",
                             "imagetool.platforms")  # fmt: skip


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if any(p.startswith(".") for p in path.relative_to(ROOT).parts) or path.name.endswith(
                ("_pb2.py", "_pb2_grpc.py")
            ):
                continue
            yield module_name(path), path


def imports(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports, wherever in the file (``from a import b``
    counts as ``a.b`` when that is a module, else as ``a``)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")
                if not is_package:
                    parent = parent[:-1]
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def room(name: str) -> int:
    # The most specific prefix decides ("snapshotter" itself is a leaf, its rooms are not).
    best, rank = -1, -1
    for i, prefixes in enumerate(ROOMS):
        for p in prefixes:
            if _within(name, (p,)) and len(p) > best:
                best, rank = len(p), i
    return rank


GRAPH = {name: imports(name, path) for name, path in sources()}


def test_snapshotter_imports_go_one_way() -> None:
    wrong = []
    for name, targets in GRAPH.items():
        if not name.startswith("snapshotter"):
            continue
        for target in targets:
            if target.startswith("snapshotter") and room(target) < room(name):
                wrong.append(f"{name} -> {target}")
            if target.startswith("imagetool") and not _within(target, IMAGETOOL_FOR_SNAPSHOTTER):
                wrong.append(f"{name} -> {target}")
            if target.split(".")[0] in ("serving", "runtime"):
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the rooms' order:\n" + "\n".join(sorted(wrong))


@pytest.mark.parametrize(
    ("package", "allowed"),
    [("lazyblock", ("lazyblock",)), ("imagetool", ("imagetool", "lazyblock")),
     ("serving", ("serving", "lazyblock")),
     ("runtime", ("runtime", "serving.wire", "serving.errors", "lazyblock")),
     ("serving.wire", ("serving.wire", "serving.errors"))],
)  # fmt: skip
def test_packages_import_only_what_they_may(package: str, allowed: tuple[str, ...]) -> None:
    wrong = [
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if _within(name, (package,))
        for target in targets
        if not _within(target, allowed) and target != "serving"
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_module_imports_itself_back() -> None:
    """No cycle among modules, counting imports inside functions too (such an import
    hides a cycle from Python, not from a reader)."""
    graph = {n: {t for t in ts if t in GRAPH and t != n} for n, ts in GRAPH.items()}
    # A package's __init__ is imported with any of its modules: not an edge of its own.
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if nxt.startswith(node + "."):
                continue  # a package importing its own module
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif state.get(nxt) is None:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
