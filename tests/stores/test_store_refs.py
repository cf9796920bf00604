"""Reference parsing and ``open_store``."""

from __future__ import annotations

from pathlib import Path

import pytest

from imagetool.errors import InvalidReferenceError, NotFoundError
from imagetool.format import BLOB_MEDIA_TYPE
from imagetool.stores import ImageRef, StoreOptions, absolute_ref, open_store, parse_ref
from imagetool.stores.dir import DirStore
from imagetool.stores.registry import RegistryStore
from imagetool.stores.s3 import S3Store

D = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/srv/images/app", ImageRef("/srv/images", "app", "latest")),
        ("/srv/images/app:v1", ImageRef("/srv/images", "app", "v1")),
        (f"/srv/images/app@{D}", ImageRef("/srv/images", "app", None, D)),
        (f"/srv/images/app:v1@{D}", ImageRef("/srv/images", "app", "v1", D)),
        ("/app:v1", ImageRef("/", "app", "v1")),
        ("./store/my-app.x:1.0_rc", ImageRef("./store", "my-app.x", "1.0_rc")),
        ("file:///srv/images/app:v2", ImageRef("/srv/images", "app", "v2")),
        ("file://localhost/srv/app", ImageRef("/srv", "app", "latest")),
        ("s3://bucket/app:v1", ImageRef("s3://bucket", "app", "v1")),
        ("s3://my.bucket/a/b/app", ImageRef("s3://my.bucket/a/b", "app", "latest")),
        (f"s3://bucket/p/app@{D}", ImageRef("s3://bucket/p", "app", None, D)),
        ("docker://reg.example/app", ImageRef("docker://reg.example", "app", "latest")),
        (
            "docker://127.0.0.1:5000/team/sub/app:v1",
            ImageRef("docker://127.0.0.1:5000", "team/sub/app", "v1"),
        ),
        (
            f"docker://localhost:5000/team/app@{D}",
            ImageRef("docker://localhost:5000", "team/app", None, D),
        ),
        ("docker://[::1]:5000/app:x", ImageRef("docker://[::1]:5000", "app", "x")),
    ],
)
def test_parse_ref(text: str, expected: ImageRef) -> None:
    ref = parse_ref(text)
    assert ref == expected
    assert parse_ref(str(ref)) == ref


@pytest.mark.parametrize(
    "text",
    [
        "",
        "app:v1",  # no store
        "/srv/images/",
        "/srv/images/App",  # uppercase name
        "/srv/images/app:",  # empty tag
        "/srv/images/app:-x",
        "/srv/images/app:" + "x" * 129,
        "/srv/images/app@sha256:abc",
        "/srv/images/app@md5:" + "0" * 32,
        "/srv/my images/app",
        "file://remote-host/srv/app",
        "file://",
        "s3://bucket",
        "s3://bucket/",
        "s3://B/app",
        "s3://bucket//app",
        "s3://bucket/../app",
        "docker://reg.example",
        "docker://reg.example/",
        "docker:///app",
        "docker://reg.example/Team/app",
        "docker://reg.example/team//app",
        "docker://bad_host!/app",
        "ftp://host/app",
    ],
)
def test_parse_ref_rejects(text: str) -> None:
    with pytest.raises(InvalidReferenceError) as e:
        parse_ref(text)
    assert "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_open_store(tmp_path: Path) -> None:
    store = open_store(f"{tmp_path}/app:v1")
    assert isinstance(store, DirStore)
    assert (store.root, store.name) == (tmp_path, "app")
    registry = open_store("docker://127.0.0.1:5000/team/app:v1", StoreOptions(plain_http=True))
    assert isinstance(registry, RegistryStore)
    assert (registry.url, registry.name) == ("docker://127.0.0.1:5000/team/app", "team/app")
    assert registry.client.base == "http://127.0.0.1:5000/v2/team/app"
    registry.close()
    assert open_store("docker://reg.example/app").client.base.startswith("https://")


def test_open_s3_store(s3_bucket: str) -> None:
    with open_store(f"s3://{s3_bucket}/pre/fix/app:v1") as store:
        assert isinstance(store, S3Store)
        assert (store.bucket, store.prefix, store.name) == (s3_bucket, "pre/fix", "app")
        assert store.list_tags() == []


def test_resolve_ref_by_index_digest(tmp_path: Path, image) -> None:
    store = open_store(f"{tmp_path}/app")
    store.put_blob(image.blob_digest, image.blob, BLOB_MEDIA_TYPE)
    store.publish("v1", image.index_bytes)
    by_digest = parse_ref(f"{tmp_path}/app@{image.index_digest}")
    assert store.resolve_ref(by_digest) == image.index_digest
    with pytest.raises(NotFoundError):
        store.resolve_ref(parse_ref(f"{tmp_path}/app@{D}"))
    with pytest.raises(NotFoundError):
        store.resolve_ref(parse_ref(f"{tmp_path}/app:nope"))


def test_absolute_ref_anchors_only_relative_directory_stores(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    assert absolute_ref("store/app:v1") == f"{tmp_path}/store/app:v1"
    assert absolute_ref("./a/../store/app") == f"{tmp_path}/store/app:latest"
    assert absolute_ref(f"store/app@{D}") == f"{tmp_path}/store/app@{D}"
    for text in ("/srv/app", "file:///srv/app", "s3://bucket/app:v1", "docker://h:5000/a/app"):
        assert absolute_ref(text) == text  # as written
    with pytest.raises(InvalidReferenceError):
        absolute_ref("store/app:bad tag")


def test_exports() -> None:
    import imagetool.stores as stores

    for name in stores.__all__:
        assert getattr(stores, name) is not None
    assert stores.DirStore is DirStore and stores.S3Store is S3Store
    assert stores.RegistryStore is RegistryStore
