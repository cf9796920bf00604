"""The docs live in the repository and stay true to it: every relative link in the README,
docs/ and deploy/ names a file that exists, no tracked file refers to a place outside the
repository, and docs/troubleshooting.md covers every error kind a command can print."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy/README.md"]
# Places outside the repository that files used to name.
OUTSIDE = re.compile(r"\.\./shared|(?<![\w.*])/work/|shared/DESIGN")
# Exception types that never reach a user as the Kind of an error line: the fork server's
# own (a mount falls back to starting its server), label parsing inside the daemon (it
# becomes containerd's error, whose message the guide quotes), the data path's own (EIO in
# the container), the serving data path's internal fetch error and watch restart.
INTERNAL = {"snapshotter.ForkServerError", "snapshotter.ForkServerUnavailable",
            "snapshotter.KeychainError", "snapshotter.RemoteLayerError",
            "snapshotter.ClosedError", "snapshotter.InvalidReadError", "snapshotter.ReadError",
            "serving.ResourceExpired", "serving.FetchError"}  # fmt: skip


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / line for line in out.stdout.splitlines()]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_name_files_that_exist(doc: Path) -> None:
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def test_no_file_refers_outside_the_repository() -> None:
    offenders = []
    for path in tracked():
        if path == Path(__file__) or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert offenders == []


def error_kinds() -> set[str]:
    """``package.Name`` of the exception classes whose names a command can print."""
    kinds = set()
    files = tracked()  # not what a build put beside them (runtime's venv holds torch's tests)
    for package in ("imagetool", "snapshotter", "serving", "runtime", "lazyblock"):
        for path in files:
            if path.suffix != ".py" or path.parts[len(ROOT.parts)] != package:
                continue
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                    continue
                bases = [getattr(b, "id", getattr(b, "attr", "")) for b in node.bases]
                if any(b.endswith(("Error", "Exception")) for b in bases):
                    kinds.add(f"{package}.{node.name}")
    return kinds


def test_troubleshooting_covers_every_error_kind() -> None:
    guide = (ROOT / "docs/troubleshooting.md").read_text()
    kinds = error_kinds() - INTERNAL
    assert len(kinds) > 40
    missing = sorted(k for k in kinds if not re.search(rf"\b{k.split('.')[1]}\b", guide))
    assert missing == []
