"""The configuration file and its overrides (no root needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapshotter.config import KEYS, ConfigError, MountConfig, PrefetchMode, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "config.toml.example"


def test_file_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(
        '[cache]\ndir = "/srv/cache"\nsize = "2GiB"\n'
        '[prefetch]\nbackground_fetch = true\nbandwidth = "100MiB"\n'
        '[fetch]\nretries = 5\n[store]\nplain_http = true\n[metrics]\nlisten = ":9000"\n'
    )
    cfg = load_config(path, {"cache.size": "3GiB", "fetch.deadline": "7.5"})
    m = cfg.mount
    assert m.cache_dir == Path("/srv/cache") and m.cache_size == 3 << 30
    assert m.prefetch_mode is PrefetchMode.FULL and m.prefetch_bandwidth == 100 << 20
    assert m.fetch.retries == 5 and m.fetch.deadline == 7.5 and m.store.plain_http
    assert cfg.metrics_listen == ":9000"
    assert load_config(path, {"prefetch.enabled": "false"}).mount.prefetch_mode is PrefetchMode.NONE


def test_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown configuration key 'cache.colour'"):
        load_config(None, {"cache.colour": "blue"})
    with pytest.raises(ConfigError, match="cache.size"):
        load_config(None, {"cache.size": "lots"})
    with pytest.raises(ConfigError, match="backing"):
        load_config(None, {"mount.backing": "floppy"})
    bad = tmp_path / "bad.toml"
    bad.write_text("[cache\n")
    with pytest.raises(ConfigError):
        load_config(bad)
    with pytest.raises(ConfigError):
        load_config(tmp_path / "missing.toml")


def test_mount_config_round_trips_through_json() -> None:
    cfg = load_config(None, {"store.docker_config": "/root/.docker/config.json"}).mount
    assert MountConfig.from_dict(cfg.to_dict()) == cfg


def test_example_documents_every_key() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.mount == MountConfig()  # the example shows the defaults
    text = EXAMPLE.read_text()
    section = None
    documented = set()
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif "=" in line and section:
            documented.add(f"{section}.{line.split('=')[0].strip().lstrip('# ')}")
    assert set(KEYS) <= documented


def test_one_file_for_mounts_and_the_daemon() -> None:
    from snapshotter.config import (
        DEFAULT_ADDRESS,
        DEFAULT_REMOUNT_INTERVAL,
        DEFAULT_ROOT,
        DEFAULT_WORKERS,
    )

    config = load_config(EXAMPLE)
    service = config.service
    assert (service.address, service.root) == (DEFAULT_ADDRESS, DEFAULT_ROOT)
    assert service.workers == DEFAULT_WORKERS
    assert service.remount_interval == DEFAULT_REMOUNT_INTERVAL
    assert service.insecure_registries == () and config.mount == MountConfig()


def test_daemon_paths_given_relative_are_absolute(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """containerd and the kubelet reach the daemon's sockets and its snapshots' paths from
    their own directories."""
    monkeypatch.chdir(tmp_path)
    flags = {
        "snapshotter.address": "s.sock",
        "snapshotter.root": "root",
        "snapshotter.image_service_address": "cri.sock",
    }
    service = load_config(EXAMPLE, flags).service
    assert service.address == tmp_path / "s.sock" and service.root == tmp_path / "root"
    assert service.image_service_address == tmp_path / "cri.sock"
