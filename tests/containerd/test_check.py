"""``snapshotter check`` against real nodes: the containerd harness's node (Debian's 1.6 with
a version 2 config, 2.x with the deploy file, version 3) passes; containerds started with
broken copies of the same config fail, each with the line that names what is wrong and
its fix. The check reads the config file, asks the running containerd (Version,
Introspection) and the daemon's socket, as it would on a node.

Marked root + integration: CI runs them as root (``.ci/run``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import harness
import pytest
from harness import Containerd, unmount_under
from support import Registry

pytestmark = [pytest.mark.root, pytest.mark.integration]


def run_check(node: Containerd, *args: str, as_json: bool = True) -> tuple[int, Any]:
    """``snapshotter check`` of ``node`` as its admin runs it: containerd's config and
    socket, the daemon's lazyblock config (its socket is a flag of the daemon's, so --set)."""
    proc = subprocess.run(
        [sys.executable, "-m", "snapshotter", "check", *(["--json"] if as_json else []),
         "--containerd-config", str(node.config), "--containerd-address", str(node.address),
         "--config", str(node.snapshotter.config),
         "--set", f"snapshotter.address={node.snapshotter.address}", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout) if as_json else proc.stdout


def lines(doc: dict[str, Any], name: str) -> list[dict[str, str]]:
    return [c for c in doc["checks"] if c["name"] == name]


def statuses(doc: dict[str, Any], *names: str) -> list[str]:
    return [c["status"] for name in names for c in lines(doc, name)]


@contextmanager
def containerd_with(
    node: Containerd, root: Path, edit: Callable[[str], str]
) -> Iterator[Containerd]:
    """Another containerd of the node's flavour, with the node's config changed by ``edit``,
    using the node's lazyblock daemon."""
    root.mkdir()
    other = Containerd(root, node.snapshotter, "127.0.0.1:1", node.flavour, edit)
    try:
        yield other
    finally:
        other.stop()
        unmount_under(root)


def without_proxy_plugin(text: str) -> str:
    """The config without its [proxy_plugins] tables (comments in them go too)."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        header = re.match(r"\s*\[\[?([^\]]+)", line)
        if header:
            skipping = header.group(1).startswith("proxy_plugins")
        if not skipping:
            out.append(line)
    result = "".join(out)
    assert "proxy_plugins" not in result
    return result


def replace(text: str, old: str, new: str) -> str:
    assert old in text, f"the harness config no longer has {old!r}"
    return text.replace(old, new)


def test_a_correct_node_passes(
    node: Containerd, registry: Registry, lazy_image: tuple[str, dict[str, Any]]
) -> None:
    ref, _ = lazy_image
    code, doc = run_check(node, "--registry", ref, "--set",
                          f"snapshotter.insecure_registries={registry.host}")  # fmt: skip
    assert code == 0 and doc["ok"] is True, doc
    bad = [c for c in doc["checks"] if c["status"] != "ok"]
    assert bad == []
    version = "1.6." if node.flavour.name == "1.6" else "2."
    assert f"containerd {version}" in lines(doc, "containerd")[0]["message"]
    assert lines(doc, "snapshotter-daemon")[0]["message"] == (
        f"proxy plugin lazyblock at {node.snapshotter.address} (reachable: lazyblock's daemon "
        "answers the snapshots API)"
    )
    names = [c["name"] for c in doc["checks"]]
    expected = ["lazyblock-config", "containerd", "containerd-config", "proxy-plugin",
                "snapshotter-daemon", "containerd-plugin", "cri-snapshotter", "cri-annotations",
                "fuse", "erofs", "backing", "cache-dir", "state-dir", "registry"]  # fmt: skip
    if node.flavour.config_version >= 3:
        expected[8:8] = ["transfer-exports", "transfer-unpack"]
    assert names == expected
    assert "resolves anonymously: a lazyblock block image" in lines(doc, "registry")[0]["message"]
    # The same as text, one line per check; 'doctor' is the same command.
    code, text = run_check(node, as_json=False)
    assert code == 0
    assert f"ok   proxy plugin lazyblock at {node.snapshotter.address} (reachable" in text
    assert all(line.startswith("ok   ") for line in text.splitlines()), text


def test_without_the_proxy_plugin(node: Containerd, tmp_path: Path) -> None:
    with containerd_with(node, tmp_path / "c", without_proxy_plugin) as broken:
        code, doc = run_check(broken)
    assert code == 1 and doc["ok"] is False
    [plugin] = lines(doc, "proxy-plugin")
    assert plugin["status"] == "fail"
    assert plugin["message"].startswith(f"no [proxy_plugins.lazyblock] in {broken.config}")
    assert plugin["fix"].startswith(
        f'add [proxy_plugins.lazyblock] with type = "snapshot" and address = '
        f'"{node.snapshotter.address}"'
    )
    # The running containerd has no such snapshotter either.
    [loaded] = lines(doc, "containerd-plugin")
    assert loaded["status"] == "fail"
    assert loaded["message"] == "the running containerd has no snapshotter 'lazyblock'"
    assert lines(doc, "snapshotter-daemon") == []


def test_with_annotations_disabled(node: Containerd, tmp_path: Path) -> None:
    """CRI that hides the image labels fails. On 2.1 that takes a setting that keeps CRI
    pulling locally too: with neither, CRI pulls through the transfer service, which passes
    the labels with the proxy plugin's exports key (passes) and not without it (fails)."""
    v3 = node.flavour.config_version >= 3
    hidden = "disable_snapshot_annotations = true\n"
    if v3:
        hidden += "  use_local_image_pull = true\n"

    def edit(text: str) -> str:
        return replace(text, "disable_snapshot_annotations = false\n", hidden)

    with containerd_with(node, tmp_path / "c", edit) as broken:
        code, doc = run_check(broken)
    assert code == 1
    failures = [c["name"] for c in doc["checks"] if c["status"] == "fail"]
    assert failures == ["cri-annotations"]
    [line] = lines(doc, "cri-annotations")
    assert line["message"].startswith(
        "CRI hides image labels from snapshotters (disable_snapshot_annotations is true"
    )
    section = ('plugins."io.containerd.cri.v1.images"' if v3
               else 'plugins."io.containerd.grpc.v1.cri".containerd')  # fmt: skip
    assert line["fix"].startswith(
        f"set disable_snapshot_annotations = false under [{section}], then restart containerd"
    )
    if not v3:
        return

    def transfer(text: str) -> str:
        return replace(text, "  disable_snapshot_annotations = false\n", "")

    with containerd_with(node, tmp_path / "transfer", transfer) as ok:
        code, doc = run_check(ok)
    assert code == 0, doc
    assert "CRI pulls through the transfer service" in lines(doc, "cri-annotations")[0]["message"]

    def no_exports(text: str) -> str:
        return replace(transfer(text), '      enable_remote_snapshot_annotations = "true"\n', "")

    with containerd_with(node, tmp_path / "no-exports", no_exports) as broken:
        code, doc = run_check(broken)
    assert code == 1
    [line] = lines(doc, "transfer-exports")
    assert line["status"] == "fail"
    assert "the transfer service passes no image labels to lazyblock" in line["message"]
    assert "CRI pulls and 'ctr image pull' fetch block images in full" in line["message"]
    assert line["fix"].startswith(
        'add enable_remote_snapshot_annotations = "true" under [proxy_plugins.lazyblock.exports]'
    )


def test_a_config_for_the_other_version(node: Containerd, tmp_path: Path) -> None:
    """1.6 with the 2.x config (version 3): its settings are ignored, a failure. 2.x with the
    1.6 config (version 2): migrated when containerd starts, so it works, with a warning
    (and the transfer service, which that file does not configure, only warns: CRI pulls
    locally with it)."""
    root = tmp_path / "c"
    address, proxy = root / "containerd.sock", node.snapshotter.address
    v3 = node.flavour.config_version >= 3

    def other(text: str) -> str:
        write = harness.config_v2 if v3 else harness.config_v3
        return write(root, address, proxy, "127.0.0.1:1")

    with containerd_with(node, root, other) as mixed:
        code, doc = run_check(mixed)
    [line] = lines(doc, "containerd-config")
    if not v3:
        assert code == 1
        assert line["status"] == "fail"
        assert line["message"] == (
            f"containerd config {mixed.config} (version 3): containerd 1.x reads config version "
            "2; the settings of a version 3 file (io.containerd.cri.v1.*) are ignored"
        )
        assert line["fix"] == "write it as version 2, as deploy/containerd/config-1.6-1.7.toml"
        return
    assert code == 0, doc
    assert line["status"] == "warn"
    assert "containerd 2.x migrates it to version 3 when it starts" in line["message"]
    assert statuses(doc, "cri-snapshotter", "cri-annotations") == ["ok", "ok"]
    assert statuses(doc, "transfer-exports", "transfer-unpack") == ["warn", "warn"]


def test_with_the_plugin_at_a_dead_socket(node: Containerd, tmp_path: Path) -> None:
    dead = tmp_path / "dead.sock"

    def edit(text: str) -> str:
        return replace(text, f'"{node.snapshotter.address}"', f'"{dead}"')

    with containerd_with(node, tmp_path / "c", edit) as broken:
        code, doc = run_check(broken)
        _, text = run_check(broken, as_json=False)
    assert code == 1
    [line] = lines(doc, "snapshotter-daemon")
    assert line == {
        "name": "snapshotter-daemon",
        "status": "fail",
        "message": f"proxy plugin lazyblock at {dead}: no such socket",
        "fix": "start lazyblock's daemon (systemctl start lazyblock-snapshotter-grpc, or "
        f"snapshotter serve --address {dead}); lazyblock's config puts its socket at "
        f"{node.snapshotter.address}: make the two agree",
    }
    assert f"FAIL proxy plugin lazyblock at {dead}: no such socket \N{EM DASH} fix: " in text
    # containerd itself loaded the plugin: it dials lazily.
    assert lines(doc, "containerd-plugin")[0]["status"] == "ok"
