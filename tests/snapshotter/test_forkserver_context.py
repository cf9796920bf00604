"""The fork server's context key: what a forked mount server inherits from the fork server
rather than from its caller must name the fork server (``snapshotter.mount.forkserver``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapshotter.mount import forkserver


@pytest.fixture
def packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in source tree the key is computed over."""
    for package in ("snapshotter", "imagetool"):
        (tmp_path / package / "sub").mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "sub" / "mod.py").write_text("X = 1\n")
    monkeypatch.setattr(forkserver, "_package_root", lambda: tmp_path / "snapshotter")
    return tmp_path


def test_key_is_stable_for_the_same_context(packages: Path) -> None:
    assert forkserver.context_key() == forkserver.context_key()


def test_changed_source_means_another_fork_server(packages: Path) -> None:
    before = forkserver.context_key()
    module = packages / "imagetool" / "sub" / "mod.py"
    module.write_text("X = 22\n")
    assert forkserver.context_key() != before
    again = forkserver.context_key()
    (packages / "snapshotter" / "new.py").write_text("")
    assert forkserver.context_key() != again


def test_changed_code_path_or_limits_mean_another_fork_server(
    packages: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = forkserver.context_key()
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    assert forkserver.context_key() != before
    monkeypatch.undo()
    monkeypatch.setattr(forkserver, "_package_root", lambda: packages / "snapshotter")
    assert forkserver.context_key() == before
    monkeypatch.setattr(os, "getuid", lambda: 12345)
    assert forkserver.context_key() != before


def test_socket_name_is_abstract_and_per_key() -> None:
    a, b = forkserver.socket_name("a" * 24), forkserver.socket_name("b" * 24)
    assert a.startswith(b"\0") and a != b


def test_the_real_key_covers_the_snapshotter_package() -> None:
    """Unpatched: the key is computed over the snapshotter package this process imports,
    all its rooms included (a fork server keyed on the wrong directory would go on serving
    mounts with code that has changed since it started)."""
    import snapshotter
    from snapshotter.datapath import fetcher

    assert forkserver._package_root() == Path(snapshotter.__file__).resolve().parent
    module = Path(fetcher.__file__)
    st = module.stat()
    before = forkserver.context_key()
    try:
        os.utime(module, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        assert forkserver.context_key() != before
    finally:
        os.utime(module, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert forkserver.context_key() == before
