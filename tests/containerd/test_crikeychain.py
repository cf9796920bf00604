"""The CRI keychain's bookkeeping (no containerd needed; the end-to-end path through real
containerd is in test_cri_auth.py)."""

from __future__ import annotations

import base64

import pytest

from snapshotter.config import MountConfig
from snapshotter.containerd.keychain.cri import Keychain, KeychainError, secret_from_auth
from snapshotter.containerd.mounter import MountBackend
from snapshotter.containerd.proto import load_cri

cri = load_cri()


def auth(**fields: str):  # noqa: ANN201
    return cri.AuthConfig(**fields)


def test_auth_forms() -> None:
    assert secret_from_auth(auth(username="u", password="p")).as_tuple() == ("u", "p")
    encoded = base64.b64encode(b"user:pa:ss").decode()
    assert secret_from_auth(auth(auth=encoded)).as_tuple() == ("user", "pa:ss")
    assert secret_from_auth(auth()) is None
    assert secret_from_auth(auth(registry_token="t")) is None
    for bad in ("not base64!", base64.b64encode(b"no-colon").decode()):
        with pytest.raises(KeychainError, match="AuthConfig.auth"):
            secret_from_auth(auth(auth=bad))
    assert "p4ss" not in repr(secret_from_auth(auth(username="u", password="p4ss")))


def test_record_lookup_undo() -> None:
    keys = Keychain()
    first = keys.record("reg.example:5000/team/app:v1", auth(username="u", password="one"))
    assert first is not None
    # Any tag or digest of the repository, which is what mounts and remounts name.
    assert keys.lookup("reg.example:5000", "team/app") == ("u", "one")
    assert keys.lookup("reg.example:5000", "team/other") is None
    second = keys.record("reg.example:5000/team/app@sha256:" + "0" * 64,
                         auth(username="u", password="two"))  # fmt: skip
    assert second is not None
    assert keys.lookup("reg.example:5000", "team/app") == ("u", "two")
    keys.undo(second)  # that pull failed: the previous credentials are back
    assert keys.lookup("reg.example:5000", "team/app") == ("u", "one")
    keys.undo(first)
    assert keys.lookup("reg.example:5000", "team/app") is None


def test_docker_hub_names_and_server_address() -> None:
    keys = Keychain()
    token = keys.record("busybox", auth(username="u", password="p",
                                        server_address="https://index.docker.io/v1/"))  # fmt: skip
    assert token is not None
    assert keys.lookup("registry-1.docker.io", "library/busybox") == ("u", "p")
    # Credentials for another host are not used for this image's mounts.
    elsewhere = auth(username="u", password="p", server_address="other.example")
    assert keys.record("reg.example/app:v1", elsewhere) is None
    assert keys.lookup("reg.example", "app") is None


def test_mounts_get_the_recorded_credentials(tmp_path) -> None:  # noqa: ANN001
    backend = MountBackend(MountConfig(state_dir=tmp_path), ("reg.example:5000",))
    backend.keychain.record("reg.example:5000/team/app:v1", auth(username="u", password="s3"))
    config = backend.config_for("docker://reg.example:5000/team/app@sha256:" + "1" * 64)
    assert config.store.credentials == ("u", "s3") and config.store.plain_http
    assert "s3" not in repr(config)
    # Carried to the mount server in its JSON request, and back.
    assert MountConfig.from_dict(config.to_dict()).store.credentials == ("u", "s3")
    other = backend.config_for("docker://reg.example:5000/team/other@sha256:" + "1" * 64)
    assert other.store.credentials is None


def test_adopted_credentials_give_way_to_a_pull() -> None:
    """What a restarted daemon takes back from its mount servers is used until a pull of
    the repository records newer ones, and never replaces those."""
    from snapshotter.containerd.keychain.cri import Secret
    from snapshotter.containerd.mounter import repository_of

    keys = Keychain()
    host, repository = repository_of("docker://reg.example:5000/team/app@sha256:" + "1" * 64)
    assert (host, repository) == ("reg.example:5000", "team/app")
    assert keys.adopt(host, repository, Secret("u", "from-mount-server"))
    assert keys.lookup("reg.example:5000", "team/app") == ("u", "from-mount-server")
    assert not keys.adopt(host, repository, Secret("u", "another-server"))
    assert keys.lookup("reg.example:5000", "team/app") == ("u", "from-mount-server")
    keys.record("reg.example:5000/team/app:v2", auth(username="u", password="pulled"))
    assert not keys.adopt(host, repository, Secret("u", "from-mount-server"))
    assert keys.lookup("reg.example:5000", "team/app") == ("u", "pulled")
