"""The mount server's control socket, at any depth of state directory."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from snapshotter.mount import control


@pytest.mark.parametrize("depth", [1, 12])
def test_requests_are_answered_whatever_the_socket_path_length(tmp_path: Path, depth: int) -> None:
    directory = tmp_path.joinpath(*[f"level-{i:02d}" for i in range(depth)])
    directory.mkdir(parents=True)
    path = directory / "control.sock"
    deep = len(str(path)) > control.MAX_SOCKET_PATH
    assert deep == (depth > 1)  # both cases are exercised
    server = control.ControlServer(path, {"echo": lambda r: r["value"]}).start()
    try:
        assert control.request(path, "echo", value=[1, "two"]) == [1, "two"]
        assert stat.S_ISSOCK(path.lstat().st_mode)  # named where asked, not elsewhere
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600
        with pytest.raises(control.ControlError, match="KeyError"):
            control.request(path, "nope")
    finally:
        server.close()
    with pytest.raises(control.ControlError, match="does not answer"):
        control.request(path, "echo", value=1, timeout=1.0)
