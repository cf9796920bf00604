"""The CRI keychain: registry credentials from the kubelet's pulls, for lazy mounts.

A kubelet sends a pod's image pull secret in CRI ``PullImage``'s ``AuthConfig``. containerd
uses it for what it fetches itself (manifest, config), but a proxy snapshotter never sees it,
so the mount of a lazyblock layer from a registry that wants credentials would fail. As
stargz-snapshotter does, ``snapshotter serve`` can therefore also serve the CRI image service
(``runtime.v1.ImageService``) on a socket of its own (``[snapshotter]
image_service_address``), which the kubelet is pointed at (``--image-service-endpoint``):

* every call is forwarded to containerd's CRI socket (``containerd_address``) as the bytes it
  received, and the answer (or error status) goes back as containerd gave it, so methods and
  fields this module does not declare pass through untouched;
* a ``PullImage`` with credentials first records them in memory, keyed by the image's
  registry host and repository, so that the mounts its Prepare calls trigger, and later
  remounts of those layers while the daemon runs, authenticate with them. If the pull fails,
  the repository's previous credentials (if any) are put back.

Credentials are held in this process's memory and handed to each mount server in its start
request (``StoreOptions.credentials``; a pipe or the fork server's socket): never written to
disk, never logged (log lines name images and hosts only). Accepted forms:
``username``/``password`` and ``auth`` (base64
``user:password``). ``identity_token`` and ``registry_token`` are not usable for mounts: such
a pull is forwarded and the mounts fall back to the node's docker config (a warning says so).
Daemon restarts: the mount servers outlive the daemon and each holds, in memory, the
credentials it was started with. A daemon that starts asks every live mount server for them
over its control socket (root-only, in the state directory) and ``adopt``s them before it
remounts anything, so a layer remounted after the restart (its mount server killed later)
authenticates as before. Nothing is written to disk. What is still lost: credentials of
images whose every mount server is gone too (a reboot, a pod deletion that kills them): such
a remount fails with ``AuthError``, which the daemon logs and counts
(``lazyblock_remount_failures_total{reason="auth"}``) and retries every
``remount_interval``, until the kubelet pulls the image again or the node's docker config
has them.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from imagetool.registry.auth import decode_auth
from imagetool.stores.refs import registry_host, split_image_ref
from snapshotter.containerd.proto import load_cri

log = logging.getLogger(__name__)

SERVICE = "runtime.v1.ImageService"
PULL_IMAGE = f"/{SERVICE}/PullImage"
# containerd's own gRPC limit: ListImages on a node with many images is large.
MAX_MESSAGE = 16 << 20
_MESSAGE_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]


class KeychainError(ValueError):
    """Credentials in a PullImage that cannot be read (the pull is refused)."""


@dataclass(frozen=True)
class Secret:
    """Registry credentials for one repository (the secret never shows in a repr)."""

    username: str
    password: str = field(repr=False)

    def as_tuple(self) -> tuple[str, str]:
        return (self.username, self.password)


def secret_from_auth(auth: Any) -> Secret | None:
    """An ``AuthConfig`` message -> ``Secret``, None when it carries nothing usable."""
    if auth.username:
        return Secret(auth.username, auth.password)
    if auth.auth:
        try:
            return Secret(*decode_auth(auth.auth))
        except ValueError:
            raise KeychainError("AuthConfig.auth is not base64 of user:password") from None
    return None


class Keychain:
    """Credentials recorded from CRI pulls, by (registry host, repository); memory only."""

    def __init__(self) -> None:
        self._secrets: dict[tuple[str, str], Secret] = {}
        self._lock = threading.Lock()

    def record(self, image: str, auth: Any) -> tuple[tuple[str, str], Secret | None] | None:
        """Remember the credentials of a pull of ``image``. Returns what ``undo`` needs to
        put the previous ones back, or None when nothing was recorded."""
        host, repository = split_image_ref(image)
        if auth.server_address and registry_host(auth.server_address) != registry_host(host):
            log.warning(
                "CRI pull of %s: credentials are for %s, not %s; not used for its mounts",
                image, registry_host(auth.server_address), host,
            )  # fmt: skip
            return None
        secret = secret_from_auth(auth)
        if secret is None:
            if auth.identity_token or auth.registry_token:
                log.warning(
                    "CRI pull of %s: identity/registry tokens cannot be used for lazy mounts; "
                    "its mounts use the node's docker config", image,
                )  # fmt: skip
            return None
        key = (registry_host(host), repository)
        with self._lock:
            previous = self._secrets.get(key)
            self._secrets[key] = secret
        log.info("CRI pull of %s: registry credentials recorded for %s/%s", image, *key)
        return key, previous

    def adopt(self, host: str, repository: str, secret: Secret) -> bool:
        """Take in credentials a mount server of ``host/repository`` was started with (a
        restarted daemon's); a pull's, recorded since, win. Whether they were taken."""
        key = (registry_host(host), repository)
        with self._lock:
            if key in self._secrets:
                return False
            self._secrets[key] = secret
        return True

    def undo(self, token: tuple[tuple[str, str], Secret | None]) -> None:
        key, previous = token
        with self._lock:
            if previous is None:
                self._secrets.pop(key, None)
            else:
                self._secrets[key] = previous

    def lookup(self, host: str, repository: str) -> tuple[str, str] | None:
        """(username, password) last recorded for ``host/repository``, or None."""
        with self._lock:
            secret = self._secrets.get((registry_host(host), repository))
        return secret.as_tuple() if secret else None


class _BackendError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class ImageServiceProxy(grpc.GenericRpcHandler):
    """``runtime.v1.ImageService`` forwarded to containerd, reading PullImage's credentials."""

    def __init__(self, keychain: Keychain, backend: Path) -> None:
        self.keychain = keychain
        self.backend = backend
        self.cri = load_cri()
        self._channel = grpc.insecure_channel(f"unix://{backend}", options=_MESSAGE_OPTIONS)

    def close(self) -> None:
        self._channel.close()

    def service(self, handler_call_details: Any) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if not method.startswith(f"/{SERVICE}/"):
            return None
        behaviour = self._pull if method == PULL_IMAGE else self._forward
        # No (de)serializers: requests and replies are the raw bytes on the wire.
        return grpc.unary_unary_rpc_method_handler(functools.partial(behaviour, method))

    def _call(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return self._channel.unary_unary(method)(request, timeout=context.time_remaining())
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
            details = e.details() if hasattr(e, "details") else str(e)
            raise _BackendError(code, details or "") from None

    def _forward(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return self._call(method, request, context)
        except _BackendError as e:
            context.abort(e.code, e.details)
            raise  # abort raises; for type checkers

    def _pull(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            pull = self.cri.PullImageRequest.FromString(request)
        except DecodeError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed PullImageRequest")
        image = pull.image.image
        token = None
        if pull.HasField("auth"):
            try:
                token = self.keychain.record(image, pull.auth)
            except KeychainError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"pull of {image}: {e}")
        try:
            return self._call(method, request, context)
        except _BackendError as e:
            if token is not None:
                self.keychain.undo(token)
            log.warning("CRI pull of %s failed: %s", image, e.code.name)
            context.abort(e.code, e.details)
            raise


def start_image_service(
    address: Path, keychain: Keychain, backend: Path, workers: int
) -> tuple[grpc.Server, ImageServiceProxy]:
    """A started gRPC server on unix socket ``address`` serving the proxy."""
    address.parent.mkdir(parents=True, exist_ok=True)
    if address.is_socket() or address.exists():
        address.unlink()
    proxy = ImageServiceProxy(keychain, backend)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=_MESSAGE_OPTIONS)
    server.add_generic_rpc_handlers((proxy,))
    if server.add_insecure_port(f"unix://{address}") == 0:
        proxy.close()
        raise OSError(f"cannot listen on {address}")
    server.start()
    address.chmod(0o600)
    return server, proxy
