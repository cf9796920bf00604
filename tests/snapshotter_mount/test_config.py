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
    assert load_config(None).mount.prefetch_mode is PrefetchMode.AUTO  # the default
    for value, mode in (("auto", PrefetchMode.AUTO), ("false", PrefetchMode.PROFILE)):
        m = load_config(path, {"prefetch.background_fetch": value}).mount
        assert m.prefetch_mode is mode
    m = load_config(None, {"prefetch.stream_fraction": "0.5"}).mount
    assert m.prefetch_config().stream_fraction == 0.5
    with pytest.raises(ConfigError, match="stream_fraction"):
        load_config(None, {"prefetch.stream_fraction": "2"})


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


def _hosts_toml(tmp_path: Path, text: str) -> tuple[Path, Path]:
    """(hosts directory, its reg.example/hosts.toml holding ``text``)."""
    certs = tmp_path / "certs.d"
    (certs / "reg.example").mkdir(parents=True)
    hosts = certs / "reg.example" / "hosts.toml"
    hosts.write_text(text)
    return certs, hosts


def test_registry_hosts_directory(tmp_path: Path) -> None:
    certs, hosts = _hosts_toml(
        tmp_path, '[host."http://cache.local:8080"]\n  capabilities = ["pull"]\n'
    )
    cfg = load_config(None, {"store.registry_config_path": str(certs)}).mount
    assert cfg.registry_config_path == certs
    assert [h.url for h in cfg.store.registry_hosts.hosts_for("reg.example")] == [
        "http://cache.local:8080/v2", None,
    ]  # fmt: skip
    # Handed to a mount server as JSON, parsed: the server does not read the directory.
    assert MountConfig.from_dict(cfg.to_dict()) == cfg
    assert load_config(None, {"store.registry_config_path": ""}).mount.store.registry_hosts is None
    hosts.write_text('[host."http://cache.local:8080"]\n  capabilities = ["pull", "fly"]\n')
    with pytest.raises(ConfigError, match=f"{hosts}: .*unknown capability 'fly'"):
        load_config(None, {"store.registry_config_path": str(certs)})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(None, {"store.registry_config_path": str(tmp_path / "typo")})
    with pytest.raises(ConfigError, match="mirror_timeout"):
        load_config(None, {"store.mirror_timeout": "0", "store.registry_config_path": ""})


def test_daemon_reads_the_hosts_directory_again_and_keeps_a_good_one(tmp_path: Path) -> None:
    import os

    from snapshotter.containerd.mounter import MountBackend

    certs, hosts = _hosts_toml(tmp_path, '[host."http://one:80"]\n')
    cfg = load_config(None, {"store.registry_config_path": str(certs)}).mount
    backend = MountBackend(cfg)

    def mirrors() -> list[str | None]:
        found = backend.config_for("docker://reg.example/app:v1").store.registry_hosts
        return [h.url for h in found.hosts_for("reg.example")][:-1]

    assert mirrors() == ["http://one:80/v2"]
    hosts.write_text('[host."http://two:80"]\n[host."http://three:80"]\n')
    os.utime(hosts, ns=(1, 1))  # another mtime, whatever the clock's resolution
    assert mirrors() == ["http://two:80/v2", "http://three:80/v2"]
    hosts.write_text('[host."http://four:80"]\n  skip_verify = "no"\n')  # malformed
    assert mirrors() == ["http://two:80/v2", "http://three:80/v2"]  # the previous one kept
