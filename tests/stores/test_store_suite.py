"""The shared store suite: every backend (dir, S3 via moto, a real registry) behaves alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from imagetool.errors import (
    DigestMismatchError,
    FormatError,
    NotFoundError,
    StoreError,
)
from imagetool.format import BLOB_MEDIA_TYPE, Index, sha256_digest
from imagetool.stores import ImageRef
from imagetool.stores.base import Store

MISSING = "sha256:" + "0" * 64


def put(store: Store, image) -> None:
    store.put_blob(image.blob_digest, image.blob, BLOB_MEDIA_TYPE)


def test_put_has_size_read_range(store: Store, image) -> None:
    assert not store.has_blob(image.blob_digest)
    put(store, image)
    put(store, image)  # a second put is a no-op
    size = len(image.blob)
    assert store.has_blob(image.blob_digest)
    assert store.blob_size(image.blob_digest) == size
    assert store.read_range(image.blob_digest, 0, size) == image.blob
    assert store.read_range(image.blob_digest, 5, 100) == image.blob[5:105]
    assert store.read_range(image.blob_digest, size - 1, 1) == image.blob[-1:]
    assert store.read_range(image.blob_digest, 0, 0) == b""
    assert store.read_range(image.blob_digest, size, 0) == b""


def test_read_range_out_of_range(store: Store, image) -> None:
    put(store, image)
    size = len(image.blob)
    for offset, length in [(-1, 1), (0, -1), (size - 1, 2), (size, 1), (size + 10, 0)]:
        with pytest.raises(StoreError):
            store.read_range(image.blob_digest, offset, length)


def test_open_range_streams_the_same_bytes_in_pieces(store: Store, image) -> None:
    put(store, image)
    size = len(image.blob)
    offset, length = 7, size - 20
    got = bytearray(length)
    view = memoryview(got)
    with store.open_range(image.blob_digest, offset, length) as body:
        cut = [0, 1, 1000, length // 3, length // 2, length]  # pieces of any size, in order
        for lo, hi in zip(cut, cut[1:], strict=False):
            body.readinto(view[lo:hi])
        assert body.position == length
        with pytest.raises(ValueError):
            body.readinto(memoryview(bytearray(1)))  # past the range asked for
    assert got == image.blob[offset : offset + length]
    with store.open_range(image.blob_digest, size, 0) as body:
        body.readinto(memoryview(b""))
    # closing early is fine: the rest is never read
    with store.open_range(image.blob_digest, 0, size) as body:
        first = bytearray(10)
        body.readinto(memoryview(first))
    assert first == image.blob[:10]


def test_open_range_errors_are_read_range_errors(store: Store, image) -> None:
    put(store, image)
    size = len(image.blob)
    for offset, length in [(-1, 1), (0, -1), (size - 1, 2), (size, 1), (size + 10, 0)]:
        with pytest.raises(StoreError):
            with store.open_range(image.blob_digest, offset, length) as body:
                body.readinto(memoryview(bytearray(max(0, length))))
    with pytest.raises(NotFoundError):
        with store.open_range(MISSING, 0, 10) as body:
            body.readinto(memoryview(bytearray(10)))


def test_put_blob_from_path(store: Store, image, tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(image.blob)
    store.put_blob(image.blob_digest, path, BLOB_MEDIA_TYPE)
    assert store.read_blob(image.blob_digest) == image.blob
    assert path.read_bytes() == image.blob  # the source is left alone


def test_missing_blob(store: Store) -> None:
    assert not store.has_blob(MISSING)
    with pytest.raises(NotFoundError):
        store.blob_size(MISSING)
    with pytest.raises(NotFoundError):
        store.read_range(MISSING, 0, 10)
    with pytest.raises(NotFoundError):
        store.read_blob(MISSING)


def test_invalid_digest_is_refused(store: Store) -> None:
    with pytest.raises(FormatError):
        store.has_blob("sha256:../../etc/passwd")


def test_read_blob_verifies_digest(store: Store, image, monkeypatch) -> None:
    put(store, image)
    assert store.read_blob(image.blob_digest) == image.blob
    real = store.read_range

    def corrupt(digest: str, offset: int, length: int) -> bytes:
        data = bytearray(real(digest, offset, length))
        data[0] ^= 0xFF
        return bytes(data)

    monkeypatch.setattr(store, "read_range", corrupt)
    with pytest.raises(DigestMismatchError):
        store.read_blob(image.blob_digest)


def test_failed_upload_leaves_no_blob(store: Store, image, tmp_path: Path) -> None:
    wrong = sha256_digest(b"something else")
    with pytest.raises(DigestMismatchError):
        store.put_blob(wrong, image.blob, BLOB_MEDIA_TYPE)
    assert not store.has_blob(wrong)
    path = tmp_path / "blob"
    path.write_bytes(image.blob)
    with pytest.raises(DigestMismatchError):
        store.put_blob(wrong, path, BLOB_MEDIA_TYPE)
    assert not store.has_blob(wrong)
    with pytest.raises(StoreError):
        store.put_blob(image.blob_digest, tmp_path / "does-not-exist", BLOB_MEDIA_TYPE)
    assert not store.has_blob(image.blob_digest)


def test_publish_resolve_list_tags(store: Store, image) -> None:
    assert store.list_tags() == []
    put(store, image)
    digest = store.publish("v1", image.index_bytes)
    assert digest == image.index_digest
    assert store.resolve("v1") == digest
    assert store.read_blob(digest) == image.index_bytes
    store.publish("latest", image.index_bytes)
    assert store.list_tags() == ["latest", "v1"]
    assert store.resolve_ref(ImageRef(store.url, store.name, "v1")) == digest
    assert store.resolve_ref(ImageRef(store.url, store.name)) == digest


def test_a_plain_json_index_still_publishes_and_opens(store: Store, image) -> None:
    """Images written before indexes were compressed carry the JSON itself."""
    put(store, image)
    plain = image.index.to_bytes()
    digest = store.publish("old", plain)
    assert digest == sha256_digest(plain) != image.index_digest
    assert store.resolve("old") == digest
    assert Index.from_bytes(store.read_blob(digest)) == image.index
    assert Index.from_bytes(image.index_bytes) == image.index  # the compressed one


def test_overwrite_tag(store: Store, tiny_image: Callable) -> None:
    first, second = tiny_image(1), tiny_image(2)
    for img in (first, second):
        store.put_blob(img.blob_digest, img.blob, BLOB_MEDIA_TYPE)
    assert store.publish("v1", first.index_bytes) == first.index_digest
    assert store.publish("v1", second.index_bytes) == second.index_digest
    assert store.resolve("v1") == second.index_digest
    assert store.list_tags() == ["v1"]


def test_missing_tag(store: Store, image) -> None:
    with pytest.raises(NotFoundError):
        store.resolve("nope")
    put(store, image)
    store.publish("v1", image.index_bytes)
    with pytest.raises(NotFoundError):
        store.resolve("v2")


def test_publish_refuses_missing_data_blob(store: Store, image) -> None:
    with pytest.raises(NotFoundError, match="data blob"):
        store.publish("v1", image.index_bytes)
    with pytest.raises(NotFoundError):
        store.resolve("v1")
    assert store.list_tags() == []


def test_publish_refuses_bad_index(store: Store, image) -> None:
    put(store, image)
    with pytest.raises(FormatError):
        store.publish("v1", b"{not json")
    with pytest.raises(FormatError):
        store.publish("v1", b'{"version": 99}')
    with pytest.raises(ValueError):
        store.publish("bad tag!", image.index_bytes)
    assert store.list_tags() == []
