"""Every lazyblock command meets errors the same way (``lazyblock.cli``): a tool's error is
one line on stderr, ``PROG: error: Kind: message``, and exit code 3; a usage error is
Click's message and exit code 2. Run as users run them, through ``python -m``."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from lazyblock.cli import EXIT_ERROR, EXIT_USAGE

ERRORS = [
    ("imagetool", ["imagetool.cli", "inspect", "/nonexistent-store/app:v1"]),
    ("imagetool", ["imagetool.cli", "inspect", "docker://bad host/app"]),
    ("snapshotter", ["snapshotter", "status", "--config", "/nonexistent/config.toml"]),
    ("snapshotter", ["snapshotter", "status", "--set", "cache.size=lots"]),
    ("serving", ["serving.cli", "router", "--listen", "nope"]),
    ("runtime", ["runtime.cli", "warm-up", "http://127.0.0.1:9", "--timeout", "0.2"]),
]


@pytest.mark.parametrize(("prog", "argv"), ERRORS, ids=[" ".join(a[1:3]) for _, a in ERRORS])
def test_a_tools_error_is_one_line_and_exit_3(prog: str, argv: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_ERROR, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(rf"{prog}: error: [A-Z]\w+: \S.*", lines[0]), lines
    assert "_:" not in lines[0]  # no class name with a trailing underscore


@pytest.mark.parametrize("module", ["imagetool.cli", "snapshotter", "serving.cli", "runtime.cli"])
def test_a_usage_error_is_exit_2(module: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", module, "--no-such-option"], capture_output=True, text=True
    )
    assert r.returncode == EXIT_USAGE and "No such option" in r.stderr, r.stderr
