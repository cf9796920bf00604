"""containerd's configuration as ``snapshotter check`` reads it, per containerd version: the
deploy files, containerd's defaults and migrations, imports, errors (no containerd here; the
same files against real containerd are in tests/containerd/test_check.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapshotter.containerd.ctrdconfig import (
    ContainerdConfigError,
    ProxyPlugin,
    UnpackEntry,
    read_containerd_config,
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_V2 = ROOT / "deploy/containerd/config-1.6-1.7.toml"
DEPLOY_V3 = ROOT / "deploy/containerd/config-2.x.toml"
SOCK = "/run/lazyblock/snapshotter.sock"


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_1_6_deploy_file_on_containerd_1_6() -> None:
    cfg = read_containerd_config(DEPLOY_V2, major=1)
    assert cfg.version == 2
    assert cfg.proxy_plugins() == {"lazyblock": ProxyPlugin("lazyblock", "snapshot", SOCK, {})}
    cri = cfg.cri_images(1, 6)
    assert (cri.enabled, cri.snapshotter, cri.annotations, cri.transfer) == (
        True, "lazyblock", True, False)  # fmt: skip
    assert cri.section == 'plugins."io.containerd.grpc.v1.cri".containerd'
    assert cfg.grpc_address() is None


def test_the_2_x_deploy_file_on_containerd_2_1() -> None:
    cfg = read_containerd_config(DEPLOY_V3, major=2)
    assert cfg.version == 3
    plugin = cfg.proxy_plugins()["lazyblock"]
    assert (plugin.type, plugin.address) == ("snapshot", SOCK)
    assert plugin.exports == {"enable_remote_snapshot_annotations": "true"}
    cri = cfg.cri_images(2, 1)
    # disable_snapshot_annotations = false makes 2.1's CRI pull locally, with the labels.
    assert (cri.snapshotter, cri.annotations, cri.transfer, cri.local_reason) == (
        "lazyblock", True, False, "disable_snapshot_annotations")  # fmt: skip
    assert cri.section == 'plugins."io.containerd.cri.v1.images"'
    assert cfg.unpack_config() == [UnpackEntry("linux/amd64", "lazyblock", "walking")]
    assert not cfg.checks_platform()


def test_cri_pull_modes_of_2_x(tmp_path: Path) -> None:
    """2.1 pulls through the transfer service unless a local-only setting is there; 2.0
    always pulls locally."""
    without = DEPLOY_V3.read_text().replace("  disable_snapshot_annotations = false\n", "")
    assert without != DEPLOY_V3.read_text()
    cfg = read_containerd_config(write(tmp_path, without), major=2)
    cri = cfg.cri_images(2, 1)
    assert (cri.annotations, cri.transfer, cri.local_reason) == (False, True, "")
    assert cfg.cri_images(2, 0).transfer is False
    assert cfg.cri_images(2, 0).local_reason == "containerd 2.0"
    for extra, reason in [
        ('[plugins."io.containerd.cri.v1.images".registry.mirrors."r.example"]\n'
         'endpoint = ["https://m.example"]\n', "registry.mirrors"),
        ('[plugins."io.containerd.cri.v1.images"]\nmax_concurrent_downloads = 5\n',
         "max_concurrent_downloads"),
        ('[plugins."io.containerd.cri.v1.images"]\nuse_local_image_pull = true\n',
         "use_local_image_pull = true"),
    ]:  # fmt: skip
        text = without.replace('[plugins."io.containerd.cri.v1.images"]\n', "")
        text = text.replace('  snapshotter = "lazyblock"\n', "", 1)
        text = text.replace('  [plugins."io.containerd.cri.v1.images".registry]\n', "")
        text = text.replace('    config_path = "/etc/containerd/certs.d"\n', "", 1)
        cfg = read_containerd_config(write(tmp_path, text + extra, "local.toml"), major=2)
        cri = cfg.cri_images(2, 1)
        assert (cri.transfer, cri.local_reason) == (False, reason)


def test_containerd_defaults(tmp_path: Path) -> None:
    for major, minor in ((1, 6), (2, 1)):
        cfg = read_containerd_config(write(tmp_path, "version = 2\n"), major=major)
        cri = cfg.cri_images(major, minor)
        assert (cri.snapshotter, cri.annotations) == ("overlayfs", False)
        assert cfg.proxy_plugins() == {}
        assert cfg.unpack_config() is None  # containerd's own: overlayfs and erofs
    assert read_containerd_config(write(tmp_path, ""), major=1).version == 1


def test_a_version_2_file_on_2_x_is_read_as_migrated(tmp_path: Path) -> None:
    """2.x moves the version 2 CRI keys to io.containerd.cri.v1.images (over what that table
    has), as its configMigration does."""
    text = DEPLOY_V2.read_text() + (
        '[plugins."io.containerd.cri.v1.images"]\n  snapshotter = "overlayfs"\n'
    )
    cfg = read_containerd_config(write(tmp_path, text), major=2)
    cri = cfg.cri_images(2, 1)
    assert (cri.snapshotter, cri.annotations, cri.transfer) == ("lazyblock", True, False)
    # A version 3 file's images table is its own: the old CRI table is not read.
    text3 = text.replace("version = 2", "version = 3")
    assert read_containerd_config(write(tmp_path, text3), major=2).cri_images(2, 1).snapshotter == (
        "overlayfs")  # fmt: skip


def test_version_1_short_plugin_names(tmp_path: Path) -> None:
    text = (
        '[proxy_plugins.lazyblock]\ntype = "snapshot"\naddress = "/s.sock"\n'
        '[plugins.cri.containerd]\nsnapshotter = "lazyblock"\n'
        "disable_snapshot_annotations = false\n"
    )
    cfg = read_containerd_config(write(tmp_path, text), major=1)
    assert cfg.version == 1
    cri = cfg.cri_images(1, 6)
    assert (cri.snapshotter, cri.annotations) == ("lazyblock", True)
    cfg = read_containerd_config(write(tmp_path, 'disabled_plugins = ["cri"]\n'), major=1)
    assert cfg.cri_images(1, 6).enabled is False


def test_disabled_cri(tmp_path: Path) -> None:
    path = write(tmp_path, 'version = 3\ndisabled_plugins = ["io.containerd.grpc.v1.cri"]\n')
    assert read_containerd_config(path, major=2).cri_images(2, 1).enabled is False
    path = write(tmp_path, 'version = 2\ndisabled_plugins = ["io.containerd.grpc.v1.cri"]\n')
    assert read_containerd_config(path, major=1).cri_images(1, 6).enabled is False


def test_imports_merge_as_containerd_merges(tmp_path: Path) -> None:
    """Imports: relative to the importing file, globs as they are; a later
    [proxy_plugins.X] replaces the earlier one; a plugin table is replaced whole on 1.x,
    merged key by key on 2.x."""
    main = write(tmp_path, (
        f'version = 2\nimports = ["{tmp_path}/conf.d/*.toml", "extra.toml"]\n'
        '[proxy_plugins.lazyblock]\ntype = "snapshot"\naddress = "/old.sock"\n'
        '[proxy_plugins.lazyblock.exports]\nkept = "no"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd]\nsnapshotter = "lazyblock"\n'
    ))  # fmt: skip
    write(tmp_path, (
        '[proxy_plugins.lazyblock]\ntype = "snapshot"\naddress = "/new.sock"\n'
        '[plugins."io.containerd.grpc.v1.cri".containerd]\n'
        "disable_snapshot_annotations = false\n"
    ), "conf.d/10-lazyblock.toml")  # fmt: skip
    write(tmp_path, 'imports = ["config.toml"]\n[grpc]\naddress = "/c.sock"\n', "extra.toml")
    for major, snapshotter in ((1, "overlayfs"), (2, "lazyblock")):
        cfg = read_containerd_config(main, major=major)
        assert [p.name for p in cfg.files] == ["config.toml", "10-lazyblock.toml", "extra.toml"]
        assert cfg.proxy_plugins()["lazyblock"] == ProxyPlugin(
            "lazyblock", "snapshot", "/new.sock", {})  # fmt: skip
        cri = cfg.cri_images(major, 1)
        assert (cri.snapshotter, cri.annotations) == (snapshotter, True)
        assert cfg.grpc_address() == Path("/c.sock")


def test_socket_address_of_config_version_4(tmp_path: Path) -> None:
    text = 'version = 4\n[plugins."io.containerd.server.v1.grpc"]\naddress = "/v4.sock"\n'
    assert read_containerd_config(write(tmp_path, text), major=2).grpc_address() == Path(
        "/v4.sock")  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [("version = 2\n[proxy_plugins\n", "config.toml: "),
     ('version = 2\nimports = ["missing.toml"]\n', "cannot read "),
     (b"version = 2\n\xff\xfe\n", "not a text file")],
)  # fmt: skip
def test_unreadable_files_are_one_error(tmp_path: Path, text: str | bytes, message: str) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ContainerdConfigError, match=message) as e:
        read_containerd_config(path)
    assert "\n" not in str(e.value)


def test_wrongly_typed_keys_read_as_absent(tmp_path: Path) -> None:
    text = (
        'version = 2\nproxy_plugins = "x"\n[plugins]\n"io.containerd.grpc.v1.cri" = 3\n'
        '[plugins."io.containerd.transfer.v1.local"]\nunpack_config = "lazyblock"\n'
    )
    cfg = read_containerd_config(write(tmp_path, text), major=2)
    assert cfg.proxy_plugins() == {}
    assert cfg.cri_images(1, 6).snapshotter == "overlayfs"
    assert cfg.unpack_config() is None
