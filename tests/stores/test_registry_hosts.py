"""containerd's hosts directory (``imagetool.registry.hosts``): the namespaces, URLs, fields
and certificate files as containerd's docs/hosts.md describes them, and malformed files
refused with the file and the problem named."""

from __future__ import annotations

from pathlib import Path

import pytest

from imagetool.errors import HostsConfigError
from imagetool.registry.hosts import (
    HostsConfig,
    RegistryHost,
    load_hosts_dir,
    namespace_names,
    parse_duration,
)


def _write(root: Path, namespace: str, text: str) -> Path:
    (root / namespace).mkdir(parents=True, exist_ok=True)
    path = root / namespace / "hosts.toml"
    path.write_text(text)
    return path


def test_mirrors_in_file_order_then_the_server(tmp_path: Path) -> None:
    (tmp_path / "docker.io").mkdir()
    (tmp_path / "docker.io" / "mirror.crt").write_text("pem")
    _write(
        tmp_path,
        "docker.io",
        'server = "https://registry-1.docker.io"\n'
        '[host."https://public-mirror.example.com"]\n  capabilities = ["pull"]\n'
        '[host."http://10.0.0.5:5000/cache"]\n  capabilities = ["pull", "resolve"]\n'
        '  ca = "mirror.crt"\n  dial_timeout = "1.5s"\n'
        '  [host."http://10.0.0.5:5000/cache".header]\n    x-tier = ["a", "b"]\n'
        '[host."https://odd.example/v2/upstream"]\n  override_path = true\n',
    )
    config = load_hosts_dir(tmp_path)
    hosts = config.hosts_for("registry-1.docker.io")  # Docker Hub's namespace is docker.io
    assert [h.url for h in hosts] == [
        "https://public-mirror.example.com/v2",
        "http://10.0.0.5:5000/cache/v2",
        "https://odd.example/v2/upstream",
        "https://registry-1.docker.io/v2",
    ]
    assert [h.mirror for h in hosts] == [True, True, True, False]
    assert hosts[0].capabilities == ("pull",)
    assert hosts[2].capabilities == ("pull", "resolve", "push")
    assert hosts[1].ca == (str(tmp_path / "docker.io" / "mirror.crt"),)
    assert hosts[1].dial_timeout == 1.5
    assert hosts[1].header == (("x-tier", "a"), ("x-tier", "b"))
    # Travels to a mount server as data and comes back the same.
    assert HostsConfig.from_dict(config.to_dict()) == config


def test_namespace_lookup_order(tmp_path: Path) -> None:
    assert namespace_names("reg.example:5000") == [
        "reg.example_5000_", "reg.example:5000", "_default",
    ]  # fmt: skip
    assert namespace_names("registry-1.docker.io") == ["docker.io", "_default"]
    _write(tmp_path, "_default", '[host."http://tier:80"]\n')
    _write(tmp_path, "reg.example:5000", 'server = "http://reg.example:5000"\n')
    _write(tmp_path, "reg.example_5000_", '[host."http://first"]\n')
    config = load_hosts_dir(tmp_path)
    # The first directory that exists wins (reg.example:5000's server is not used).
    assert [h.url for h in config.hosts_for("reg.example:5000")] == ["http://first/v2", None]
    assert [h.url for h in config.hosts_for("other.example")] == ["http://tier:80/v2", None]
    # No server named: the registry itself, last; an unknown directory root: just it.
    assert config.hosts_for("x") == (
        RegistryHost(url="http://tier:80/v2"),
        RegistryHost(None, mirror=False),
    )
    assert load_hosts_dir(tmp_path / "none").hosts_for("x") == (RegistryHost(None, mirror=False),)


def test_docker_certificate_files_without_hosts_toml(tmp_path: Path) -> None:
    ns = tmp_path / "reg.example"
    ns.mkdir()
    for name in ("ca.crt", "client.cert", "client.key"):
        (ns / name).write_text("pem")
    (server,) = load_hosts_dir(tmp_path).hosts_for("reg.example")
    assert server.url is None and not server.mirror
    assert server.ca == (str(ns / "ca.crt"),)
    assert server.client == ((str(ns / "client.cert"), str(ns / "client.key")),)


def test_go_durations() -> None:
    assert parse_duration("1s") == 1.0
    assert parse_duration("1m30s") == 90.0
    assert parse_duration("250ms") == 0.25
    for bad in ("1", "s", "1x", "1s2"):
        with pytest.raises(ValueError):
            parse_duration(bad)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("server = [", "not valid TOML"),
        ("server = 5", '"server" must be a URL string'),
        ('[host."ftp://m"]\n', "is not an http(s) URL"),
        ('[host."http://m"]\ncapabilities = ["pull", "fly"]\n', "unknown capability 'fly'"),
        ('[host."http://m"]\nskip_verify = "yes"\n', "'skip_verify' must be true or false"),
        ('[host."http://m"]\nca = "missing.pem"\n', "ca file"),
        ('[host."http://m"]\ndial_timeout = "soon"\n', "dial_timeout: not a duration"),
        ('[host."http://m"]\nproxy = "socks5://p:1080"\n', "http(s) proxies only"),
        ('[host."http://m"]\n[host."http://m".header]\n"bad name" = "v"\n', "not a valid HTTP"),
        ('[host."http://m"]\nclient = [["a"]]\n', "invalid 'client' entry"),
        ('host = "http://m"\n', '"host" must be tables'),
    ],
)
def test_malformed_files_name_the_file_and_the_problem(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = _write(tmp_path, "reg.example", text)
    with pytest.raises(HostsConfigError) as info:
        load_hosts_dir(tmp_path)
    message = str(info.value)
    assert str(path) in message and problem in message and "\n" not in message


def test_a_required_directory_must_exist(tmp_path: Path) -> None:
    with pytest.raises(HostsConfigError, match="does not exist"):
        load_hosts_dir(tmp_path / "nope", required=True)
