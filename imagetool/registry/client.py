"""A small OCI distribution-spec client (httpx): manifests, blobs, ranged reads, uploads, tags.

Used by the registry store (``imagetool.stores.registry``), the registry image source and
the snapshotter. One ``RegistryClient`` talks to one repository on one registry. Ranged blob
reads, the snapshotter's data path, go through ``imagetool.registry.ranged`` (``http.client``,
received straight into the caller's buffers) when the registry answers with the range;
anything else is asked again through httpx, which owns auth challenges, retries and error
mapping. Authentication (credentials, challenges, tokens) is ``imagetool.registry.auth``'s.

Timeouts: ``options.timeout`` bounds connecting and every read, so a registry that accepts the
connection and never answers fails with ``StoreTimeoutError`` after that long; timeouts are
not retried (the caller decides). Idempotent requests (GET, HEAD) are retried
``options.retries`` times with exponential backoff and full jitter on connection errors and on
429/5xx. Errors are mapped to ``imagetool.errors`` with one-line messages naming host and
repository.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import logging
import os
import random
import re
import ssl
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, NoReturn, cast
from urllib.parse import urlencode, urljoin, urlsplit

import httpx

from imagetool.errors import (
    AuthError,
    DigestMismatchError,
    ImageToolError,
    NotFoundError,
    StoreError,
    StoreTimeoutError,
)
from imagetool.format import check_digest
from imagetool.registry.auth import RETRY_STATUS, Auth, one_line
from imagetool.registry.hosts import RegistryHost, namespace_name
from imagetool.registry.ranged import DirectBody, RangeClient, RangeResponse
from imagetool.stores.base import BytesBody, RangeBody, StoreOptions
from imagetool.stores.refs import registry_host

log = logging.getLogger(__name__)

# Uploads of up to this many bytes go in one PUT; bigger files in PATCH chunks of UPLOAD_CHUNK
# (each chunk is held in memory so it can be re-sent after an auth challenge).
MONOLITHIC_LIMIT = 64 << 20
UPLOAD_CHUNK = 32 << 20
# Backoff between retries: full jitter over BASE * 2**attempt, capped.
BACKOFF_BASE = 0.2
BACKOFF_CAP = 5.0
USER_AGENT = "lazyblock-imagetool"


def default_ssl_context() -> ssl.SSLContext:
    """The TLS context every client of this process verifies registries with: httpx's own
    default (``SSL_CERT_FILE``/``SSL_CERT_DIR`` if set, else certifi's bundle), built once
    per set of those variables. Loading a CA bundle takes tens of milliseconds, which a
    mount pays on its critical path; an ``SSLContext`` is safe to share between clients."""
    return _ssl_context(os.environ.get("SSL_CERT_FILE", ""), os.environ.get("SSL_CERT_DIR", ""))


@functools.lru_cache(maxsize=4)
def _ssl_context(cert_file: str, cert_dir: str) -> ssl.SSLContext:
    del cert_file, cert_dir  # the cache key: create_ssl_context reads them from the environment
    return httpx.create_ssl_context(verify=True, trust_env=True)


def host_ssl_context(host: RegistryHost) -> Callable[[], ssl.SSLContext]:
    """The TLS context for a host of a hosts directory: the default one, or with its ``ca``
    files trusted on top, its ``client`` certificates, or no verification (``skip_verify``),
    built once per process."""
    if not (host.ca or host.client or host.skip_verify):
        return default_ssl_context
    return lambda: _host_ssl_context(
        host.ca, host.client, host.skip_verify,
        os.environ.get("SSL_CERT_FILE", ""), os.environ.get("SSL_CERT_DIR", ""),
    )  # fmt: skip


@functools.lru_cache(maxsize=16)
def _host_ssl_context(
    ca: tuple[str, ...], client: tuple[tuple[str, str], ...], skip_verify: bool,
    cert_file: str, cert_dir: str,
) -> ssl.SSLContext:  # fmt: skip
    del cert_file, cert_dir  # the cache key, as in _ssl_context
    context = httpx.create_ssl_context(verify=True, trust_env=True)
    try:
        for path in ca:
            context.load_verify_locations(cafile=path)
        for cert, key in client:
            context.load_cert_chain(cert, key or None)
    except (OSError, ssl.SSLError) as e:
        raise StoreError(f"cannot load a registry host's certificates: {one_line(e)}") from None
    if skip_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def registry_hosts(options: StoreOptions, registry: str) -> tuple[RegistryHost, ...]:
    """The hosts to ask for ``registry``'s content, in order; the last is its server (the
    registry itself unless the hosts directory names another)."""
    if options.registry_hosts is None:
        return (RegistryHost(url=None, mirror=False),)
    return options.registry_hosts.hosts_for(registry)


class RegistryClient:
    """One repository of one registry, at one host: the registry's server (by default, as
    the hosts directory says, if any) or a mirror of it (``endpoint``).

    The host's settings from the hosts directory apply: its URL (and ``?ns=REGISTRY`` on
    every request when it is another host than the registry), TLS, headers, dial timeout
    and proxy. Credentials: docker ``config.json``'s for the host asked, and those given at
    run time (``options.credentials``, a CRI pull's, which name the image's registry) only
    to the registry's own host, never to a mirror. A mirror is asked with
    ``options.mirror_timeout`` and no retries of its own: the next host is its retry."""

    def __init__(
        self, host: str, repository: str, options: StoreOptions,
        endpoint: RegistryHost | None = None,
    ) -> None:  # fmt: skip
        self.host = host
        self.repository = repository
        self.endpoint = endpoint = endpoint or registry_hosts(options, host)[-1]
        api = endpoint.url or f"{'http' if options.plain_http else 'https'}://{host}/v2"
        parts = urlsplit(api)
        self.api_host = parts.netloc
        own = registry_host(self.api_host) == registry_host(host)
        timeout = options.timeout
        if endpoint.mirror:
            timeout = min(timeout, options.mirror_timeout)
        self.options = options = dataclasses.replace(
            options, timeout=timeout, retries=0 if endpoint.mirror else options.retries,
            plain_http=parts.scheme == "http", credentials=options.credentials if own else None,
        )  # fmt: skip
        self.api = api  # the host's API root (``.../v2``)
        self.base = f"{api}/{repository}"
        self._query = "" if own else "?" + urlencode({"ns": namespace_name(host)})
        self.where = f"{self.api_host}/{repository}"
        self.monolithic_limit = MONOLITHIC_LIMIT
        self.upload_chunk = UPLOAD_CHUNK
        ssl_context = host_ssl_context(endpoint)
        connect = min(timeout, endpoint.dial_timeout or timeout)
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=connect),
            follow_redirects=False,
            headers=[("User-Agent", USER_AGENT), *endpoint.header],
            verify=ssl_context(),
            proxy=endpoint.proxy,
        )
        self._headers: dict[str, str] = {}
        for name, value in endpoint.header:
            before = self._headers.get(name)
            self._headers[name] = f"{before}, {value}" if before is not None else value
        # Ranged blob reads, the data path, go through http.client when the answer is the
        # range asked for (``_direct_range``): read into the caller's buffers, a quarter of
        # httpx's CPU per byte.
        self._ranges = RangeClient(
            ssl_context=ssl_context, timeout=timeout, user_agent=USER_AGENT,
            connect_timeout=connect, proxy=endpoint.proxy,
        )  # fmt: skip
        self.auth = Auth(self.api_host, repository, options, self._http, self._backoff, self.base)

    def _url(self, path: str) -> str:
        """The URL of ``path`` under the repository, with ``?ns=`` where it applies."""
        return f"{self.base}/{path}{self._query}"

    # --- public API -----------------------------------------------------------------------

    def get_manifest(self, reference: str, accept: Sequence[str]) -> tuple[bytes, str, str]:
        """(body, media type, digest) of a manifest by tag or digest; a digest reference is
        verified against the body."""
        what = f"manifest {reference}"
        resp = self._request(
            "GET", self._url(f"manifests/{reference}"), what, headers={"Accept": ", ".join(accept)}
        )
        body = resp.content
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise DigestMismatchError(f"{self.where}: manifest {reference} hashes to {digest}")
        media_type = resp.headers.get("Content-Type", "").split(";")[0].strip()
        if not media_type or media_type in ("application/json", "text/plain"):
            with contextlib.suppress(ValueError, AttributeError):
                media_type = str(json.loads(body).get("mediaType") or media_type)
        return body, media_type, digest

    def ping(self) -> str | None:
        """``GET /v2/`` without credentials (the distribution spec's API version check):
        None if the registry lets anyone in, else the challenge of its 401
        (``WWW-Authenticate``); ``StoreError`` if it does not answer as a registry."""
        url = f"{self.base.split('/v2/', 1)[0]}/v2/"
        try:
            resp = self._http.get(url)
        except httpx.TimeoutException:
            raise StoreTimeoutError(
                f"{self.host}: API version check: no answer within {self.options.timeout:g}s"
            ) from None
        except httpx.TransportError as e:
            raise StoreError(
                f"{self.host}: API version check: {type(e).__name__}: {one_line(e)}"
            ) from None
        if resp.status_code == 200:
            return None
        if resp.status_code == 401:
            return resp.headers.get("WWW-Authenticate", "")
        raise StoreError(f"{self.host}: API version check ({url}): HTTP {resp.status_code}")

    def has_blob(self, digest: str) -> bool:
        try:
            self.blob_size(digest)
        except NotFoundError:
            return False
        return True

    def blob_size(self, digest: str) -> int:
        check_digest(digest)
        resp = self._request(
            "HEAD", self._url(f"blobs/{digest}"), f"blob {digest}", follow_redirects=True
        )
        try:
            return int(resp.headers["Content-Length"])
        except (KeyError, ValueError):
            raise StoreError(f"{self.where}: blob {digest}: no Content-Length") from None

    @contextmanager
    def open_blob(self, digest: str) -> Iterator[BinaryIO]:
        """Stream a blob. Reading it to the end verifies it against its digest."""
        check_digest(digest)
        resp = self._request(
            "GET",
            self._url(f"blobs/{digest}"),
            f"blob {digest}",
            headers={"Accept-Encoding": "identity"},
            stream=True,
            follow_redirects=True,
        )
        reader = _BlobReader(resp, digest, self.where)
        try:
            yield cast(BinaryIO, reader)
        finally:
            resp.close()

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes of a blob at ``offset``, with a ranged GET."""
        what = f"blob {digest}"
        if length == 0:
            self._check_empty_range(digest, offset)
            return b""
        direct = self._direct_range(digest, offset, length)
        if direct is not None:
            with direct:
                data = direct.read_all(length, f"{self.where}: {what}")
            if len(data) != length:
                raise StoreError(
                    f"{self.where}: {what}: range {offset}+{length} returned {len(data)} bytes"
                )
            return data
        resp = self._ranged_get(digest, offset, length)
        try:
            data = _read_at_most(resp, length + 1, self.where, what)
        finally:
            resp.close()
        if len(data) != length:
            raise StoreError(
                f"{self.where}: {what}: range {offset}+{length} returned {len(data)} bytes"
            )
        return data

    def open_range(self, digest: str, offset: int, length: int) -> RangeBody:
        """``read_range``'s bytes as they arrive (``Store.open_range``)."""
        if length == 0:
            self._check_empty_range(digest, offset)
            return BytesBody(f"{self.where}: blob {digest}", b"")
        direct = self._direct_range(digest, offset, length)
        if direct is not None:
            return DirectBody(direct, f"{self.where}: blob {digest}", length)
        return _ResponseBody(self._ranged_get(digest, offset, length), self.where, digest, length)

    def _direct_range(self, digest: str, offset: int, length: int) -> RangeResponse | None:
        """A GET of ``[offset, offset+length)`` (length > 0) through ``self._ranges``: the
        response if it is exactly that range, else None, and ``_ranged_get`` asks again with
        httpx, which answers auth challenges, retries with backoff, and maps errors (so an
        answer other than the range costs a second request). Timeouts are raised here."""
        check_digest(digest)
        if offset < 0:
            return None  # _ranged_get says why
        auth = self.auth.header(push=False)
        headers = {**self._headers, "Authorization": auth} if auth else self._headers
        resp, _ = self._ranges.get_range(
            self._url(f"blobs/{digest}"), offset, length, headers, f"{self.where}: blob {digest}"
        )
        return resp

    def _check_empty_range(self, digest: str, offset: int) -> None:
        check_digest(digest)
        if offset < 0:
            raise StoreError(f"{self.where}: blob {digest}: invalid range offset={offset}")
        size = self.blob_size(digest)
        if offset > size:
            raise StoreError(
                f"{self.where}: blob {digest}: range {offset}+0 is past the end ({size} bytes)"
            )

    def _ranged_get(self, digest: str, offset: int, length: int) -> httpx.Response:
        """The streamed response to a GET of ``[offset, offset+length)`` (length > 0),
        checked to be that range."""
        check_digest(digest)
        what = f"blob {digest}"
        if offset < 0 or length < 0:
            raise StoreError(f"{self.where}: {what}: invalid range offset={offset} length={length}")
        end = offset + length - 1
        resp = self._request(
            "GET",
            self._url(f"blobs/{digest}"),
            what,
            headers={"Range": f"bytes={offset}-{end}", "Accept-Encoding": "identity"},
            stream=True,
            follow_redirects=True,
            ok=(200, 206),
            range_ok=True,
        )
        try:
            if resp.status_code == 416:
                raise StoreError(
                    f"{self.where}: {what}: range {offset}+{length} is past the end of the blob"
                )
            if resp.status_code != 206:
                raise StoreError(
                    f"{self.where}: {what}: the registry ignored the Range header "
                    f"(HTTP {resp.status_code}); lazyblock needs a registry that serves ranges"
                )
            content_range = resp.headers.get("Content-Range", "")
            m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", content_range.strip())
            if not m or int(m[1]) != offset or int(m[2]) != end:
                raise StoreError(
                    f"{self.where}: {what}: asked for bytes {offset}-{end}, got "
                    f"{content_range or 'no Content-Range'}"
                )
        except BaseException:
            resp.close()
            raise
        return resp

    def upload_blob(self, digest: str, source: Path | bytes) -> None:
        """Upload a blob (POST, then one PUT or PATCH chunks + PUT); skipped if present.
        The registry checks the digest before the blob becomes visible."""
        check_digest(digest)
        if self.has_blob(digest):
            return
        what = f"upload of blob {digest}"
        try:
            size = source.stat().st_size if isinstance(source, Path) else len(source)
        except OSError as e:
            raise StoreError(f"{self.where}: {what}: cannot read {source}: {e.strerror}") from None
        resp = self._request(
            "POST", self._url("blobs/uploads/"), what, push=True, ok=(202, 201), idempotent=False
        )
        location = self._location(resp, what)
        try:
            if size <= self.monolithic_limit:
                body = source.read_bytes() if isinstance(source, Path) else source
                self._finish_upload(location, digest, body, what)
            else:
                location = self._upload_chunks(location, source, size, what)
                self._finish_upload(location, digest, b"", what)
        except BaseException as e:
            with contextlib.suppress(ImageToolError, httpx.HTTPError):
                self._request(
                    "DELETE", location, "cancel upload", push=True, ok=(204, 202, 200, 404),
                    idempotent=False,
                )  # fmt: skip
            if isinstance(e, OSError):
                raise StoreError(
                    f"{self.where}: {what}: cannot read {source}: {e.strerror or e}"
                ) from None
            raise
        log.debug("uploaded blob %s (%d bytes) to %s", digest, size, self.where)

    def put_manifest(self, reference: str, body: bytes, media_type: str) -> str:
        """Store a manifest under a tag or digest; returns its digest."""
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        self._request(
            "PUT",
            self._url(f"manifests/{reference}"),
            f"manifest {reference}",
            headers={"Content-Type": media_type},
            content=body,
            push=True,
            ok=(201, 200, 202),
            idempotent=False,
        )
        return digest

    def list_tags(self) -> list[str]:
        tags: list[str] = []
        url: str | None = self._url("tags/list")
        while url:
            resp = self._request("GET", url, "tag list")
            try:
                doc = resp.json()
                tags.extend(str(t) for t in doc.get("tags") or [])
            except (ValueError, AttributeError):
                raise StoreError(f"{self.where}: malformed tag list") from None
            link = resp.links.get("next", {}).get("url")
            url = urljoin(str(resp.url), link) if link else None
        return tags

    def close(self) -> None:
        self._http.close()
        self._ranges.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- uploads --------------------------------------------------------------------------

    def _location(self, resp: httpx.Response, what: str) -> str:
        location = resp.headers.get("Location")
        if not location:
            raise StoreError(f"{self.where}: {what}: registry gave no upload location")
        return urljoin(str(resp.url), location)

    def _upload_chunks(self, location: str, source: Path | bytes, size: int, what: str) -> str:
        offset = 0
        with open(source, "rb") if isinstance(source, Path) else io.BytesIO(source) as f:
            while offset < size:
                chunk = f.read(self.upload_chunk)
                if not chunk:
                    raise StoreError(f"{self.where}: {what}: source shrank while uploading")
                resp = self._request(
                    "PATCH",
                    location,
                    what,
                    headers={
                        "Content-Type": "application/octet-stream",
                        "Content-Range": f"{offset}-{offset + len(chunk) - 1}",
                    },
                    content=chunk,
                    push=True,
                    ok=(202,),
                    idempotent=False,
                )
                location = self._location(resp, what)
                offset += len(chunk)
        return location

    def _finish_upload(self, location: str, digest: str, body: bytes, what: str) -> None:
        url = httpx.URL(location)
        url = url.copy_merge_params({"digest": digest})
        try:
            self._request(
                "PUT",
                str(url),
                what,
                headers={"Content-Type": "application/octet-stream"},
                content=body,
                push=True,
                ok=(201, 204),
                idempotent=False,
            )
        except StoreError as e:
            if "DIGEST_INVALID" in str(e):
                raise DigestMismatchError(
                    f"{self.where}: {what}: the registry says the content does not match"
                ) from None
            raise

    # --- requests, retries, auth ----------------------------------------------------------

    def _request(
        self,
        method: str,
        url: str,
        what: str,
        *,
        headers: Mapping[str, str] | None = None,
        content: bytes | None = None,
        push: bool = False,
        ok: Sequence[int] = (200,),
        stream: bool = False,
        follow_redirects: bool = False,
        idempotent: bool | None = None,
        range_ok: bool = False,
    ) -> httpx.Response:
        """Send a request with auth, retries and error mapping; returns a response whose
        status is in ``ok`` (or 416, with ``range_ok``)."""
        if idempotent is None:
            idempotent = method in ("GET", "HEAD")
        attempt = 0
        challenged = False
        while True:
            hdrs = dict(headers or {})
            auth = self.auth.header(push)
            if auth:
                hdrs["Authorization"] = auth
            try:
                request = self._http.build_request(method, url, headers=hdrs, content=content)
                resp = self._http.send(request, stream=stream, follow_redirects=follow_redirects)
            except httpx.TimeoutException:
                raise StoreTimeoutError(
                    f"{self.where}: {what}: no answer within {self.options.timeout:g}s"
                ) from None
            except httpx.TransportError as e:
                if idempotent and attempt < self.options.retries:
                    attempt = self._backoff(attempt, what, one_line(e))
                    continue
                raise StoreError(
                    f"{self.where}: {what}: {type(e).__name__}: {one_line(e)}"
                ) from None
            status = resp.status_code
            if status == 401 and not challenged:
                header = resp.headers.get("WWW-Authenticate", "")
                resp.close()
                self.auth.answer(header, push, had_auth=bool(auth))
                challenged = True
                continue
            if status == 401 and auth:
                resp.close()
                self.auth.refused(what, push)
            if status in RETRY_STATUS and idempotent and attempt < self.options.retries:
                resp.close()
                attempt = self._backoff(attempt, what, f"HTTP {status}")
                continue
            if status in ok or (range_ok and status == 416):
                return resp
            try:
                if stream:
                    resp.read()
                self._raise_for(resp, what)
            finally:
                resp.close()

    def _backoff(self, attempt: int, what: str, why: str) -> int:
        delay = random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * (2**attempt)))
        log.debug("%s: %s: %s; retrying in %.2fs", self.where, what, why, delay)
        time.sleep(delay)
        return attempt + 1

    def _raise_for(self, resp: httpx.Response, what: str) -> NoReturn:
        status = resp.status_code
        detail = _registry_error(resp)
        message = f"{self.where}: {what}: HTTP {status}" + (f" {detail}" if detail else "")
        if status == 404:
            raise NotFoundError(message)
        if status in (401, 403):
            raise AuthError(message)
        raise StoreError(message)


class _BlobReader:
    """A file-like view (``read``) of a streaming blob response; verifies the digest at EOF."""

    def __init__(self, resp: httpx.Response, digest: str, where: str) -> None:
        self._chunks = resp.iter_bytes()
        self._buf = bytearray()
        self._hash = hashlib.sha256()
        self._digest = digest
        self._where = where
        self._eof = False
        length = resp.headers.get("Content-Length")
        self._expected = int(length) if length and length.isdigit() else None
        self._seen = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        while not self._eof and (n < 0 or len(self._buf) < n):
            try:
                chunk = next(self._chunks)
            except StopIteration:
                self._finish()
                break
            except httpx.TimeoutException:
                raise StoreTimeoutError(
                    f"{self._where}: blob {self._digest}: read timed out"
                ) from None
            except httpx.HTTPError as e:
                raise StoreError(f"{self._where}: blob {self._digest}: {one_line(e)}") from None
            self._hash.update(chunk)
            self._seen += len(chunk)
            self._buf += chunk
            if self._expected is not None and self._seen >= self._expected:
                self._finish()
        if n < 0 or n >= len(self._buf):
            out = bytes(self._buf)
            self._buf.clear()
        else:
            out = bytes(self._buf[:n])
            del self._buf[:n]
        return out

    def _finish(self) -> None:
        self._eof = True
        actual = "sha256:" + self._hash.hexdigest()
        if actual != self._digest:
            raise DigestMismatchError(f"{self._where}: blob {self._digest} hashes to {actual}")

    def close(self) -> None:
        pass

    def __enter__(self) -> _BlobReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_at_most(resp: httpx.Response, limit: int, where: str, what: str) -> bytes:
    """The body, or its first ``limit`` bytes or a little more. The chunks are joined once
    at the end: a body of 16 MiB costs one copy and twice its size at the peak (growing a
    bytearray and then copying it to bytes cost up to three times)."""
    chunks = []
    got = 0
    try:
        for chunk in resp.iter_bytes():
            chunks.append(chunk)
            got += len(chunk)
            if got >= limit:
                break
    except httpx.TimeoutException:
        raise StoreTimeoutError(f"{where}: {what}: read timed out") from None
    except httpx.HTTPError as e:
        raise StoreError(f"{where}: {what}: {one_line(e)}") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _ResponseBody(RangeBody):
    """A ranged GET's body, copied into the caller's buffers chunk by chunk as it arrives."""

    def __init__(self, resp: httpx.Response, where: str, digest: str, length: int) -> None:
        super().__init__(f"{where}: blob {digest}", length)
        self._resp = resp
        self._chunks = resp.iter_raw()
        self._pending = memoryview(b"")

    def _read_some(self, out: memoryview) -> int:
        if not self._pending:
            try:
                self._pending = memoryview(next(self._chunks, b""))
            except httpx.TimeoutException:
                raise StoreTimeoutError(f"{self.where}: read timed out") from None
            except httpx.HTTPError as e:
                raise StoreError(f"{self.where}: {one_line(e)}") from None
        n = min(len(out), len(self._pending))
        out[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        """Release the connection: back to the pool when the range was read to its end (the
        response is then run to its end, which is what lets httpx reuse it: a connection
        per request was a new TCP connection and a new registry handler every 2 MiB),
        closed otherwise."""
        if self.position == self.length and not self._pending:
            with contextlib.suppress(httpx.HTTPError):
                for extra in self._chunks:
                    if extra:  # more than the range: not a connection to reuse
                        break
        self._pending = memoryview(b"")
        self._resp.close()


def _registry_error(resp: httpx.Response) -> str:
    """``CODE: message`` from a distribution-spec error body, if there is one."""
    try:
        errors = resp.json().get("errors") or []
        first = errors[0]
        text = f"{first.get('code', '')}: {first.get('message', '')}".strip(": ")
    except (ValueError, AttributeError, IndexError, TypeError, httpx.ResponseNotRead):
        return ""
    return one_line(text)[:200]
