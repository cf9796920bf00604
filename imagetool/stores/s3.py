"""The S3 store (boto3).

    s3://BUCKET/PREFIX/blobs/sha256/<hex>    content-addressed blobs
    s3://BUCKET/PREFIX/refs/<name>/<tag>     one line: the index digest (or "<digest> <media
                                             type>": a platform index, ``imagetool.format``)

Credentials come from boto3's normal chain; the endpoint can be overridden with the
``AWS_ENDPOINT_URL`` environment variable, which boto3 itself honours (this module reads no
environment). S3 makes an object visible only once its upload (single or multipart) has
completed, so a failed upload leaves no blob behind. Timeouts and retries come from
``StoreOptions``; botocore errors are mapped to ``imagetool.errors`` here.

Ranged reads of blobs, the snapshotter's data path, are GETs of a presigned URL (signed
here, no request) through ``imagetool.registry.ranged``, received straight into the caller's
buffers, when S3 answers with the range; otherwise, and for everything else, boto3. Should
a presigned read be refused where boto3's own then succeeds (a bucket policy, a signature
version), or answered otherwise than with the range, presigned reads are given up for
good.
"""

from __future__ import annotations

import functools
import io
import logging
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import boto3
import botocore.exceptions
import botocore.httpsession
import botocore.loaders
import botocore.session
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from imagetool.errors import AuthError, NotFoundError, StoreError, StoreTimeoutError
from imagetool.format import check_digest, index_media_type, sha256_digest
from imagetool.registry.ranged import DirectBody, RangeClient, RangeResponse
from imagetool.stores._common import (
    check_range,
    parse_ref_line,
    ref_line,
    verify_source,
)
from imagetool.stores.base import RangeBody, Store, StoreOptions, check_publishable
from imagetool.stores.refs import check_name_component, check_tag

log = logging.getLogger(__name__)

# Files above this size go up as multipart uploads, in parts of MULTIPART_CHUNK (S3 allows at
# most 10,000 parts, so 64 MiB parts cover 640 GB).
MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNK = 64 << 20
UPLOAD_CONCURRENCY = 8
# Seconds a presigned ranged-read URL is valid: it is used at once.
PRESIGN_SECONDS = 300

_NOT_FOUND = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}
_AUTH = {
    "401",
    "403",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
}

T = TypeVar("T")


class S3Store(Store):
    """One image name under ``s3://bucket/prefix``."""

    def __init__(
        self, bucket: str, prefix: str, name: str, options: StoreOptions | None = None
    ) -> None:
        options = options or StoreOptions()
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.name = check_name_component(name)
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        config = Config(
            signature_version="s3v4",  # presigned URLs too (botocore would sign them v2)
            connect_timeout=options.timeout,
            read_timeout=options.timeout,
            retries={"total_max_attempts": options.retries + 1, "mode": "standard"},
        )
        self._client = _call(self.url, lambda: _new_client(config))
        self._transfer = TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD,
            multipart_chunksize=MULTIPART_CHUNK,
            max_concurrency=UPLOAD_CONCURRENCY,
        )
        self._ranges = RangeClient(
            ssl_context=_ssl_context, timeout=options.timeout, user_agent="lazyblock-imagetool"
        )

    # --- keys -----------------------------------------------------------------------------

    def _key(self, *parts: str) -> str:
        return "/".join([self.prefix, *parts] if self.prefix else list(parts))

    def _blob_key(self, digest: str) -> str:
        return self._key("blobs", "sha256", check_digest(digest).removeprefix("sha256:"))

    def _ref_key(self, tag: str) -> str:
        return self._key("refs", self.name, check_tag(tag))

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    # --- blobs ----------------------------------------------------------------------------

    def blob_size(self, digest: str) -> int:
        key = self._blob_key(digest)
        head = _call(
            self._where(key), lambda: self._client.head_object(Bucket=self.bucket, Key=key)
        )
        return int(head["ContentLength"])

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        key = self._blob_key(digest)
        where = self._where(key)
        check_range(where, offset, length)
        if length == 0:
            check_range(where, offset, length, self.blob_size(digest))
            return b""

        def get() -> bytes:
            with self._get_range(key, offset, length) as body:
                return body.read()

        direct, refused = self._direct_range(key, offset, length)
        if direct is not None:
            with direct:
                data = direct.read_all(length, where)
        else:
            data = _call_range(where, offset, length, get)
            self._refused(refused)
        if len(data) != length:
            raise StoreError(
                f"{where}: range {offset}+{length} returned {len(data)} bytes "
                "(past the end of the blob?)"
            )
        return data

    def open_range(self, digest: str, offset: int, length: int) -> RangeBody:
        if length == 0:
            return super().open_range(digest, offset, length)
        key = self._blob_key(digest)
        where = self._where(key)
        check_range(where, offset, length)
        direct, refused = self._direct_range(key, offset, length)
        if direct is not None:
            return DirectBody(direct, where, length)
        body = _call_range(where, offset, length, lambda: self._get_range(key, offset, length))
        self._refused(refused)
        return _S3Body(where, body, length)

    def _direct_range(self, key: str, offset: int, length: int) -> tuple[RangeResponse | None, str]:
        """A GET of bytes ``[offset, offset+length)`` (length > 0) of ``key`` through a
        presigned URL (``RangeClient.get_range``): the response if it is exactly that
        range, else None (boto3 asks again, and maps errors) and the answer that came
        instead. Timeouts are raised here."""
        if self._ranges.disabled is not None:
            return None, ""
        where = self._where(key)
        try:
            url = self._client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": key},
                ExpiresIn=PRESIGN_SECONDS,
            )  # fmt: skip
        except botocore.exceptions.BotoCoreError as e:  # boto3's own call will say why
            log.debug("%s: cannot presign: %s", where, _one_line(e))
            return None, ""
        return self._ranges.get_range(url, offset, length, {}, where)

    def _refused(self, answer: str) -> None:
        """boto3 just read a range that a presigned GET was refused (``answer``; "" if
        none was): presigned reads will not work here."""
        if answer:
            self._ranges.disable(f"{self.url}: presigned ranged reads answered {answer}")

    def _get_range(self, key: str, offset: int, length: int) -> Any:
        """The streaming body of a ranged GET."""
        resp = self._client.get_object(
            Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}"
        )
        return resp["Body"]

    def put_blob(self, digest: str, source: Path | bytes, media_type: str) -> None:
        if self.has_blob(digest):
            return
        key = self._blob_key(digest)
        where = self._where(key)
        verify_source(digest, source, where)
        extra = {"ContentType": media_type or "application/octet-stream"}
        if isinstance(source, Path):
            _call(
                where,
                lambda: self._client.upload_file(
                    str(source), self.bucket, key, ExtraArgs=extra, Config=self._transfer
                ),
            )
        else:
            _call(
                where,
                lambda: self._client.upload_fileobj(
                    io.BytesIO(source), self.bucket, key, ExtraArgs=extra, Config=self._transfer
                ),
            )
        log.debug("uploaded blob %s to %s", digest, where)

    # --- tags -----------------------------------------------------------------------------

    def resolve(self, tag: str) -> str:
        return self.resolve_tag(tag)[0]

    def resolve_tag(self, tag: str) -> tuple[str, str]:
        key = self._ref_key(tag)
        where = self._where(key)

        def get() -> bytes:
            resp = self._client.get_object(Bucket=self.bucket, Key=key)
            with resp["Body"] as body:
                return body.read()

        try:
            text = _call(where, get)
        except NotFoundError:
            raise NotFoundError(f"{self.name}:{tag} not found in {self.url}") from None
        return parse_ref_line(text.decode(errors="replace"), f"{where}: ref")

    def publish(self, tag: str, index_bytes: bytes) -> str:
        check_publishable(self, tag, index_bytes)
        digest = sha256_digest(index_bytes)
        self.put_blob(digest, index_bytes, index_media_type(index_bytes))
        self._write_ref(tag, digest, "")
        log.info("published %s:%s -> %s in %s", self.name, tag, digest, self.url)
        return digest

    def _write_ref(self, tag: str, digest: str, media_type: str) -> None:
        key = self._ref_key(tag)
        _call(
            self._where(key),
            lambda: self._client.put_object(
                Bucket=self.bucket, Key=key, Body=ref_line(digest, media_type),
                ContentType="text/plain",
            ),
        )  # fmt: skip

    def list_tags(self) -> list[str]:
        prefix = self._key("refs", self.name) + "/"

        def listing() -> list[str]:
            tags: list[str] = []
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    rest = obj["Key"][len(prefix) :]
                    if rest and "/" not in rest:
                        tags.append(rest)
            return sorted(tags)

        return _call(self.url, listing)

    def close(self) -> None:
        self._client.close()
        self._ranges.close()


_session_lock = threading.Lock()
# botocore's data files (service models, endpoint rules), parsed once per process and kept by
# this loader; a process forked after ``preload`` inherits them parsed.
_loader: Any = None


def _data_loader() -> Any:
    global _loader
    if _loader is None:
        _loader = botocore.loaders.create_loader()
    return _loader


def preload() -> None:
    """Parse what an S3 client is built from (botocore's S3 model and endpoint rules, and the
    list of every service it scans for them: ~0.5 s for a process's first client) into this
    process's loader, and build the TLS context of botocore's default CA bundle (~30 ms), so
    that clients built later here, or in processes forked from here (the snapshotter's fork
    server and its mount servers), skip that. The throwaway client it builds has its own
    session, region and dummy credentials: nothing of this process's credentials or
    configuration is read or kept."""
    session = botocore.session.Session()
    session.register_component("data_loader", _data_loader())
    session.create_client(
        "s3", region_name="us-east-1", aws_access_key_id="preload",
        aws_secret_access_key="preload",  # noqa: S106 - not a secret
    ).close()  # fmt: skip
    _ssl_context_for(botocore.httpsession.get_cert_path(True))


def _new_client(config: Config) -> Any:
    """An S3 client from boto3's default session (set up on this module's loader):
    creating clients from one session reuses its loaded service models and credentials
    (and a session is not thread-safe)."""
    with _session_lock:
        if boto3.DEFAULT_SESSION is None:
            core = botocore.session.get_session()
            core.register_component("data_loader", _data_loader())
            boto3.setup_default_session(botocore_session=core)
        return boto3.client("s3", config=config)


def _ssl_context() -> ssl.SSLContext:
    """What boto3 verifies S3 with: ``AWS_CA_BUNDLE``/``ca_bundle`` if configured, else
    botocore's default bundle (loading one takes ~30 ms: done at the first https read)."""
    with _session_lock:
        session = boto3.DEFAULT_SESSION._session if boto3.DEFAULT_SESSION else None
    bundle = session.get_config_variable("ca_bundle") if session else None
    return _ssl_context_for(bundle or botocore.httpsession.get_cert_path(True))


@functools.lru_cache(maxsize=4)
def _ssl_context_for(bundle: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=bundle)


def _call(where: str, fn: Callable[[], T]) -> T:
    """Run a boto3 call, mapping its errors to imagetool's."""
    try:
        return fn()
    except botocore.exceptions.ClientError as e:
        _raise_client_error(where, e.response)
    except S3UploadFailedError as e:
        cause = e.__context__
        if isinstance(cause, botocore.exceptions.ClientError):
            _raise_client_error(where, cause.response)
        raise StoreError(f"{where}: upload failed: {_one_line(e)}") from None
    except (
        botocore.exceptions.ConnectTimeoutError,
        botocore.exceptions.ReadTimeoutError,
    ) as e:
        raise StoreTimeoutError(f"{where}: timed out: {_one_line(e)}") from None
    except (
        botocore.exceptions.NoCredentialsError,
        botocore.exceptions.PartialCredentialsError,
    ) as e:
        raise AuthError(f"{where}: {_one_line(e)}") from None
    except botocore.exceptions.BotoCoreError as e:
        raise StoreError(f"{where}: {_one_line(e)}") from None


class _PastEnd(Exception):
    """S3 answered a ranged GET with InvalidRange (416)."""


def _call_range(where: str, offset: int, length: int, fn: Callable[[], T]) -> T:
    """``_call`` for a ranged read: a range past the end of the blob says so. Told by the
    error's code and status (the message names the bucket and key, which may hold "416")."""

    def checked() -> T:
        try:
            return fn()
        except botocore.exceptions.ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if e.response.get("Error", {}).get("Code") == "InvalidRange" or status == 416:
                raise _PastEnd from None
            raise

    try:
        return _call(where, checked)
    except _PastEnd:
        raise StoreError(f"{where}: range {offset}+{length} is past the end of the blob") from None


class _S3Body(RangeBody):
    """A ranged GET's streaming body, read a piece at a time into the caller's buffers."""

    PIECE = 1 << 20  # bytes asked of the body at once

    def __init__(self, where: str, body: Any, length: int) -> None:
        super().__init__(where, length)
        self._body = body

    def _read_some(self, out: memoryview) -> int:
        data = _call(self.where, lambda: self._body.read(min(len(out), self.PIECE)))
        out[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._body.close()


def _raise_client_error(where: str, response: dict[str, Any]) -> NoReturn:
    err = response.get("Error", {})
    code = str(err.get("Code", ""))
    status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    message = _one_line(err.get("Message") or code or f"HTTP {status}")
    if code in _NOT_FOUND or (status == "404" and code not in _AUTH):
        raise NotFoundError(f"{where}: not found")
    if code in _AUTH or status in ("401", "403"):
        raise AuthError(f"{where}: access denied ({code or status}: {message})")
    if code in ("RequestTimeout", "RequestTimeoutException"):
        raise StoreTimeoutError(f"{where}: timed out ({message})")
    raise StoreError(f"{where}: {code or 'HTTP ' + status}: {message}")


def _one_line(e: object) -> str:
    return " ".join(str(e).split())
