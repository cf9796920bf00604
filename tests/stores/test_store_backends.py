"""Directory and S3 store specifics: on-disk layout, atomic writes, multipart, error mapping."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from imagetool.errors import NotFoundError, StoreError, StoreTimeoutError
from imagetool.format import BLOB_MEDIA_TYPE, sha256_digest
from imagetool.stores import StoreOptions
from imagetool.stores.dir import DirStore
from imagetool.stores.s3 import S3Store

# --- directory store ----------------------------------------------------------------------


def test_dir_layout(tmp_path: Path, image) -> None:
    store = DirStore(tmp_path, "app")
    store.put_blob(image.blob_digest, image.blob, BLOB_MEDIA_TYPE)
    store.publish("v1", image.index_bytes)
    blobs = tmp_path / "blobs" / "sha256"
    assert sorted(p.name for p in blobs.iterdir()) == sorted(
        d.removeprefix("sha256:") for d in (image.blob_digest, image.index_digest)
    )
    assert (tmp_path / "refs" / "app" / "v1").read_text().strip() == image.index_digest
    assert not [p for p in tmp_path.rglob(".tmp-*")]


def test_dir_failed_write_leaves_nothing(tmp_path: Path, image, monkeypatch) -> None:
    store = DirStore(tmp_path, "app")

    def broken_replace(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(StoreError, match="No space left"):
        store.put_blob(image.blob_digest, image.blob, BLOB_MEDIA_TYPE)
    monkeypatch.undo()
    assert not store.has_blob(image.blob_digest)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_dir_put_from_other_filesystem_copies(tmp_path: Path, image, monkeypatch) -> None:
    source = tmp_path / "src"
    source.write_bytes(image.blob)

    def no_link(src: object, dst: object) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    store = DirStore(tmp_path / "store", "app")
    store.put_blob(image.blob_digest, source, BLOB_MEDIA_TYPE)
    assert store.read_blob(image.blob_digest) == image.blob
    assert source.read_bytes() == image.blob


def test_dir_list_tags_skips_temporaries(tmp_path: Path, image) -> None:
    store = DirStore(tmp_path, "app")
    store.put_blob(image.blob_digest, image.blob, BLOB_MEDIA_TYPE)
    store.publish("v1", image.index_bytes)
    (tmp_path / "refs" / "app" / ".tmp-abc").write_text("partial")
    assert store.list_tags() == ["v1"]


def test_dir_corrupt_ref(tmp_path: Path, image) -> None:
    store = DirStore(tmp_path, "app")
    (tmp_path / "refs" / "app").mkdir(parents=True)
    (tmp_path / "refs" / "app" / "v1").write_text("garbage")
    with pytest.raises(StoreError, match="corrupt"):
        store.resolve("v1")


# --- S3 store -------------------------------------------------------------------------------


def test_s3_multipart_upload(s3_bucket: str, tmp_path: Path) -> None:
    data = os.urandom(11 << 20)  # three 5 MiB parts, the smallest S3 allows
    path = tmp_path / "big"
    path.write_bytes(data)
    digest = sha256_digest(data)
    with S3Store(s3_bucket, "", "app") as store:
        store._transfer.multipart_threshold = 5 << 20
        store._transfer.multipart_chunksize = 5 << 20
        store.put_blob(digest, path, BLOB_MEDIA_TYPE)
        assert store.blob_size(digest) == len(data)
        assert store.read_range(digest, (5 << 20) - 3, 6) == data[(5 << 20) - 3 : (5 << 20) + 3]
        import boto3

        head = boto3.client("s3").head_object(Bucket=s3_bucket, Key=store._blob_key(digest))
        assert "-" in head["ETag"]  # a multipart upload


def test_s3_ranged_reads_are_presigned_gets(s3_bucket: str, image, monkeypatch) -> None:
    from imagetool.registry.ranged import DirectBody

    blob = image.blob
    with S3Store(s3_bucket, "", "app") as store:
        store.put_blob(image.blob_digest, blob, BLOB_MEDIA_TYPE)
        with store.open_range(image.blob_digest, 3, 1000) as body:
            assert isinstance(body, DirectBody)  # received into our buffer by http.client
            got = bytearray(1000)
            body.readinto(memoryview(got))
        assert got == blob[3:1003]
        assert store.read_range(image.blob_digest, 7, 20) == blob[7:27]
        assert store._ranges.disabled is None
        with pytest.raises(StoreError, match="past the end"):
            store.read_range(image.blob_digest, len(blob) - 5, 10)
        assert store._ranges.disabled is None  # refused, and so was boto3's own read

        # A presigned read refused where boto3's own succeeds: presigned reads are given up.
        sign = store._client.generate_presigned_url

        def other_key(op: str, Params: dict, ExpiresIn: int) -> str:  # noqa: N803
            return sign(op, Params={**Params, "Key": Params["Key"] + "x"}, ExpiresIn=ExpiresIn)

        monkeypatch.setattr(store._client, "generate_presigned_url", other_key)
        assert store.read_range(image.blob_digest, 7, 20) == blob[7:27]
        assert store._ranges.disabled and "HTTP 404" in store._ranges.disabled
        with store.open_range(image.blob_digest, 3, 10) as body:
            assert not isinstance(body, DirectBody)


def test_s3_missing_blob_in_a_bucket_named_416(s3_server: str, image) -> None:
    # "past the end" is told by S3's error code, not by "416" anywhere in the message (which
    # names the bucket): this bucket's missing blob is missing, not a range past its end.
    import uuid

    import boto3

    bucket = f"lb-416-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    with S3Store(bucket, "", "app") as store:
        with pytest.raises(NotFoundError):
            store.read_range("sha256:" + "0" * 64, 0, 10)
        store.put_blob(image.blob_digest, image.blob, BLOB_MEDIA_TYPE)
        with pytest.raises(StoreError, match="past the end"):
            store.read_range(image.blob_digest, len(image.blob) + 5, 10)


def test_s3_missing_bucket(s3_server: str) -> None:
    with S3Store("lb-no-such-bucket", "p", "app") as store:
        assert not store.has_blob("sha256:" + "0" * 64)
        with pytest.raises(NotFoundError, match="lb-no-such-bucket"):
            store.resolve("v1")


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never answers; yields its URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conns.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for c in conns:
        c.close()
    listener.close()


def test_s3_timeout(s3_server: str, silent_server: str, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", silent_server)
    with S3Store("bucket", "", "app", StoreOptions(timeout=0.5, retries=0)) as store:
        with pytest.raises(StoreTimeoutError, match="s3://bucket"):
            store.read_range("sha256:" + "0" * 64, 0, 10)


def test_registry_ranges_read_to_their_end_reuse_the_connection(
    registry, image, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A response left before its end is closed with its connection: a new TCP connection
    # and a new registry handler for every sector. (moto's S3 server closes every
    # connection itself, so this is checked against the registry only.)
    from imagetool.stores.registry import RegistryStore

    options = StoreOptions(plain_http=True, docker_config=tmp_path / "none.json")
    with RegistryStore(registry.host, "lb/reuse", options) as store:
        store.put_blob(image.blob_digest, image.blob, BLOB_MEDIA_TYPE)
        size = len(image.blob)

        def read_range(offset: int, length: int) -> bytes:
            got = bytearray(length)
            with store.open_range(image.blob_digest, offset, length) as body:
                body.readinto(memoryview(got))
            return bytes(got)

        assert read_range(0, size) == image.blob
        connects: list[object] = []
        connect = socket.socket.connect

        def counting(sock: socket.socket, address: object) -> None:
            connects.append(address)
            connect(sock, address)

        monkeypatch.setattr(socket.socket, "connect", counting)
        for offset in (0, 100, size // 2):
            assert read_range(offset, size - offset) == image.blob[offset:]
        assert connects == []
