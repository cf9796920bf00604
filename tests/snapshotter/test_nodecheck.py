"""``snapshotter check`` without a running containerd: what it says about broken config
files, sockets nothing answers on, directories, and registries (a real registry, and one
with token auth), through the command a user runs. The checks against running containerd
1.6 and 2.x are tests/containerd/test_check.py."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ocibuild import TarEntry, make_layer_tar, write_oci_layout
from support import AuthRegistry, Registry, require_root, token_auth_registry

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_V2 = ROOT / "deploy/containerd/config-1.6-1.7.toml"
USER, PASSWORD = "puller", "pw-nodecheck"


def check(
    tmp_path: Path, *args: str, containerd_config: Path | None = None,
    env: dict[str, str] | None = None, as_json: bool = True,
) -> tuple[int, Any]:  # fmt: skip
    """The command with this test's own containerd config, socket and lazyblock config."""
    config = tmp_path / "lazyblock.toml"
    if not config.exists():
        config.write_text(
            f'[cache]\ndir = "{tmp_path / "cache"}"\nsize = "64MiB"\n'
            f'[state]\ndir = "{tmp_path / "state"}"\n'
        )
    docker = tmp_path / "docker"
    docker.mkdir(exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "snapshotter", "check", *(["--json"] if as_json else []),
         "--containerd-config", str(containerd_config or tmp_path / "containerd.toml"),
         "--containerd-address", str(tmp_path / "containerd.sock"), "--config", str(config),
         *args],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "DOCKER_CONFIG": str(docker), **(env or {})},
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout) if as_json else proc.stdout


def line(doc: dict[str, Any], name: str) -> dict[str, str]:
    [found] = [c for c in doc["checks"] if c["name"] == name]
    return found


def stale_socket(path: Path) -> Path:
    """A socket file nobody listens on any more (what a killed daemon leaves)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
    return path


def test_no_containerd_a_stale_socket_and_a_broken_config(tmp_path: Path) -> None:
    """Every problem is a line with its fix, the rest is still checked, exit 1."""
    require_root()
    stale = stale_socket(tmp_path / "snap.sock")
    (tmp_path / "containerd.toml").write_text(
        DEPLOY_V2.read_text().replace("/run/lazyblock/snapshotter.sock", str(stale))
    )
    (tmp_path / "lazyblock.toml").write_text('[cache]\nsize = "lots"\n')
    code, doc = check(tmp_path, "--set", f"snapshotter.address={stale}")
    assert code == 1 and doc["ok"] is False
    lb = line(doc, "lazyblock-config")
    assert lb["status"] == "fail"
    assert "cache.size: not a size: 'lots'" in lb["message"]
    assert "deploy/config.toml.example" in lb["fix"]
    ctrd = line(doc, "containerd")
    assert ctrd["status"] == "fail"
    assert ctrd["message"].startswith(
        f"containerd does not answer at {tmp_path / 'containerd.sock'} (no such socket)"
    )
    assert "--containerd-address" in ctrd["fix"]
    daemon = line(doc, "snapshotter-daemon")
    assert daemon["status"] == "fail"
    assert daemon["message"] == (
        f"proxy plugin lazyblock at {stale}: connection refused (a socket left by a process "
        "that is gone)"
    )
    assert daemon["fix"].startswith("start lazyblock's daemon")
    # The file itself is right for 1.6/1.7 (Debian's containerd --version says which).
    for name in ("containerd-config", "proxy-plugin", "cri-snapshotter", "cri-annotations"):
        assert line(doc, name)["status"] == "ok", line(doc, name)
    assert [c["name"] for c in doc["checks"]][-5:] == [
        "fuse", "erofs", "backing", "cache-dir", "state-dir"]  # fmt: skip
    # As text: one line each, FAIL lines with their fix.
    code, text = check(tmp_path, "--set", f"snapshotter.address={stale}", as_json=False)
    assert code == 1
    assert f"FAIL proxy plugin lazyblock at {stale}: connection refused" in text
    assert len(text.splitlines()) == len(doc["checks"])
    assert all(t.startswith(("ok   ", "warn ", "FAIL ")) for t in text.splitlines())


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "no containerd config at {path}: containerd runs with its defaults"),
     ("version = 2\n[proxy_plugins.lazyblock\n", "containerd config: {path}: Expected"),
     ('version = 2\nimports = ["gone.toml"]\n', "containerd config: cannot read {dir}/gone.toml")],
)  # fmt: skip
def test_an_unusable_containerd_config_is_a_line(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "containerd.toml"
    if content is not None:
        path.write_text(content)
    code, doc = check(tmp_path)
    assert code == 1
    cfg = line(doc, "containerd-config")
    assert cfg["status"] == "fail"
    assert cfg["message"].startswith(message.format(path=path, dir=tmp_path)), cfg
    # Nothing that needs the file is checked; the node's own checks are.
    assert not [c for c in doc["checks"] if c["name"].startswith(("proxy", "cri"))]
    assert line(doc, "fuse")


def test_directories(tmp_path: Path) -> None:
    require_root()
    (tmp_path / "containerd.toml").write_text(DEPLOY_V2.read_text())
    afile = tmp_path / "afile"
    afile.write_text("")
    code, doc = check(tmp_path, "--set", f"cache.dir={afile}", "--set",
                      f"state.dir={afile}/state")  # fmt: skip
    assert code == 1
    assert line(doc, "cache-dir")["message"] == f"cache directory {afile}: not a directory"
    assert line(doc, "state-dir")["message"] == (
        f"state directory {afile}/state: absent, and {afile} is not a directory"
    )
    # A cap beyond the disk: a warning; a directory not there yet is made by the daemon.
    cache = tmp_path / "new" / "cache"
    code, doc = check(tmp_path, "--set", f"cache.dir={cache}", "--set", "cache.size=1000TiB")
    warn = line(doc, "cache-dir")
    assert warn["status"] == "warn"
    assert warn["message"].startswith(f"cache directory {cache}: writable, cap 1024000.0GiB")
    assert warn["message"].endswith("the disk fills before the cap")
    assert not cache.exists()
    assert line(doc, "state-dir")["status"] == "ok"


def convert(layout: Path, ref: str, docker_config: Path | None = None) -> None:
    env = {**os.environ, "DOCKER_CONFIG": str(docker_config)} if docker_config else None
    subprocess.run(
        [sys.executable, "-m", "imagetool.cli", "--plain-http", "convert", "-q",
         f"oci:{layout}:v1", f"docker://{ref}"],
        check=True, capture_output=True, env=env,
    )  # fmt: skip


def sample(tmp_path: Path) -> Path:
    layout = tmp_path / "img"
    write_oci_layout(layout, [make_layer_tar([TarEntry("etc/hello", data=b"hi\n")])], tag="v1")
    return layout


def test_registry_anonymous(tmp_path: Path, registry: Registry) -> None:
    (tmp_path / "containerd.toml").write_text(DEPLOY_V2.read_text())
    ref = f"{registry.host}/nodecheck/app:v1"
    convert(sample(tmp_path), ref)
    insecure = f"snapshotter.insecure_registries={registry.host}"
    _, doc = check(tmp_path, "--set", insecure, "--registry", ref, "--registry",
                   f"{registry.host}/nodecheck/app:nope", "--registry", registry.host)  # fmt: skip
    found = [c for c in doc["checks"] if c["name"] == "registry"]
    assert [c["status"] for c in found] == ["ok", "fail", "ok"]
    assert found[0]["message"].startswith(
        f"registry: {ref} resolves anonymously: a lazyblock block image (manifest sha256:"
    )
    assert found[1]["message"].startswith(
        f"registry: {registry.host}/nodecheck/app: manifest nope: HTTP 404"
    )
    assert found[2]["message"] == f"registry {registry.host} answers (anonymous access allowed)"
    # Without insecure_registries the daemon would speak TLS to it.
    _, doc = check(tmp_path, "--registry", ref)
    refused = line(doc, "registry")
    assert refused["status"] == "fail"
    assert "insecure_registries" in refused["fix"]


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("checkauth")
    with token_auth_registry(root, {USER: PASSWORD}, expires_in=30) as reg:
        yield reg


def docker_config(path: Path, host: str, password: str) -> Path:
    path.mkdir()
    auth = base64.b64encode(f"{USER}:{password}".encode()).decode()
    (path / "config.json").write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    return path


def test_registry_with_token_auth(tmp_path: Path, auth_registry: AuthRegistry) -> None:
    """Anonymous access refused: without credentials a fail that says so; with the node's
    credentials ($DOCKER_CONFIG, as the daemon reads them) it resolves; wrong ones fail."""
    (tmp_path / "containerd.toml").write_text(DEPLOY_V2.read_text())
    host = auth_registry.host
    good = docker_config(tmp_path / "good", host, PASSWORD)
    wrong = docker_config(tmp_path / "wrong", host, "not-" + PASSWORD)
    ref = f"{host}/secure/app:v1"
    convert(sample(tmp_path), ref, good)
    args = ("--set", f"snapshotter.insecure_registries={host}", "--registry", ref,
            "--registry", host)  # fmt: skip

    _, doc = check(tmp_path, *args)
    resolved, pinged = (c for c in doc["checks"] if c["name"] == "registry")
    assert resolved["status"] == "fail"
    assert resolved["message"] == (
        f"registry: {ref}: anonymous access refused and the node has no credentials for {host}"
    )
    assert resolved["fix"].startswith(f"docker login {host} (the daemon reads ")
    assert pinged["status"] == "warn"
    assert pinged["message"].startswith(f"registry {host} answers and asks for Bearer; the node "
                                        "has no credentials for it")  # fmt: skip

    _, doc = check(tmp_path, *args, env={"DOCKER_CONFIG": str(good)})
    resolved, pinged = (c for c in doc["checks"] if c["name"] == "registry")
    assert resolved["status"] == "ok", resolved
    assert resolved["message"].startswith(
        f"registry: {ref} resolves with the node's credentials for {host} (anonymous access "
        "refused): a lazyblock block image"
    )
    assert pinged["status"] == "ok"
    assert PASSWORD not in json.dumps(doc)

    _, doc = check(tmp_path, *args, env={"DOCKER_CONFIG": str(wrong)})
    resolved = next(c for c in doc["checks"] if c["name"] == "registry")
    assert resolved["status"] == "fail"
    assert "refused our credentials" in resolved["message"]
    assert resolved["fix"].startswith(f"renew the credentials for {host}")
