"""``snapshotter pull``: a lazy pull for ``ctr`` users, on containerd 1.6/1.7 (and 2.x).

containerd 1.6/1.7's ``ctr image pull`` fetches every blob before it unpacks and passes the
snapshotter no labels, so it cannot pull a block image lazily: it downloads the whole data
blob, then fails with "failed to get stream processor for
application/vnd.oci.image.layer.lazyblock...: no processor for media-type". This module does
what containerd's own client does for a pull with unpack (what stargz's ``ctr-remote image
rpull`` and SOCI's ``soci image rpull`` do), over containerd's gRPC API, with the labels the
proxy snapshotter reads (``layers``):

1. resolve the image in its registry: the manifest (through an image index, the one for this
   node's platform) and its config, and check that its layers are lazyblock's;
2. under a lease (gRPC metadata ``containerd-lease``: what is made under it survives
   containerd's garbage collector until the lease ends), write the index, manifest and
   config into containerd's content store, labelled as containerd labels them
   (``containerd.io/gc.ref.content.*``: what each references;
   ``containerd.io/gc.ref.snapshot.<snapshotter>`` on the config: the top chain ID, which
   keeps the image's snapshots while the image exists);
3. Prepare each layer on the snapshotter, key ``extract-<unique> <chain ID>`` on the parent
   layer's chain ID, with ``containerd.io/snapshot.ref`` = the chain ID, the CRI labels
   (image reference, manifest digest, layer digest, the image's layers) and the layer's
   ``containerd.io/snapshot/`` annotations. lazyblock's daemon mounts the image and commits
   each layer as a remote snapshot (``handshake``), and containerd answers ALREADY_EXISTS:
   success. No layer blob is downloaded;
4. create the image record (or point the existing one at the new target), then end the
   lease.

A pull that fails before step 4 leaves no image record, and what it made goes with its
lease (a pull killed outright leaves a lease that expires after ``LEASE_EXPIRY``). Afterwards
``ctr run --snapshotter lazyblock REF ID`` finds the image unpacked (its top chain ID's
snapshot exists) and runs it; ``ctr image rm`` lets containerd remove the snapshots, and the
daemon unmounts the image.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.field_mask_pb2 import FieldMask

from imagetool.errors import InvalidReferenceError, NotFoundError
from imagetool.format import check_digest, sha256_digest
from imagetool.platforms import Platform, available_platforms, default_platform, select_platform
from imagetool.registry.client import RegistryClient
from imagetool.stores.base import StoreOptions
from imagetool.stores.refs import DOCKER_HUB, parse_ref, registry_host
from imagetool.stores.registry import DOCKER_LIST, MANIFEST_ACCEPT, OCI_INDEX
from snapshotter.containerd.layers import (
    INHERITED_PREFIX,
    LABEL_CRI_IMAGE_LAYERS,
    LABEL_CRI_IMAGE_REF,
    LABEL_CRI_LAYER_DIGEST,
    LABEL_CRI_MANIFEST_DIGEST,
    LABEL_TARGET_REF,
    ROLE_BLOB,
    ROLE_INDEX,
    layer_role,
)
from snapshotter.containerd.proto import load_client
from snapshotter.errors import PullError

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = Path("/run/containerd/containerd.sock")
DEFAULT_NAMESPACE = "default"
DEFAULT_SNAPSHOTTER = "lazyblock"
# A pull killed outright (SIGKILL) leaves its lease; containerd drops it after this long.
LEASE_EXPIRY = timedelta(hours=1)
# Manifests, indexes and configs are read whole; containerd takes one gRPC message of up to
# 16 MiB, and no real image document comes near this.
MAX_DOCUMENT = 4 << 20
# How long containerd may take to answer its socket at all.
CONNECT_TIMEOUT = 10.0
# containerd's label keys (containerd/labels and its garbage collector).
LABEL_GC_EXPIRE = "containerd.io/gc.expire"
LABEL_GC_CONTENT = "containerd.io/gc.ref.content."
LABEL_GC_SNAPSHOT = "containerd.io/gc.ref.snapshot."
LABEL_DISTRIBUTION_SOURCE = "containerd.io/distribution.source."


@dataclass(frozen=True)
class PullOptions:
    address: Path = DEFAULT_ADDRESS  # containerd's gRPC socket
    namespace: str = DEFAULT_NAMESPACE
    snapshotter: str = DEFAULT_SNAPSHOTTER  # the [proxy_plugins] name lazyblock's daemon has
    platform: str | None = None  # os/arch[/variant]; None: this machine's
    store: StoreOptions = StoreOptions()  # how this process reads the registry
    timeout: float = 600.0  # seconds per containerd call (a layer's Prepare mounts the image)


@dataclass(frozen=True)
class ImageName:
    """An image name as containerd records it (``host/repository:tag[@digest]``, Docker
    Hub's defaults applied, as ``ctr`` needs it typed), and where it is read from."""

    name: str
    host: str  # the registry to talk to (docker.io's is registry-1.docker.io)
    repository: str
    reference: str  # the tag or digest to resolve

    @classmethod
    def parse(cls, text: str) -> ImageName:
        """``InvalidReferenceError`` if ``text`` is not an image name."""
        if "://" not in text:
            first, slash, _ = text.partition("/")
            if not (slash and ("." in first or ":" in first or first == "localhost")):
                library = "" if "/" in text.split("@", 1)[0] else "library/"
                text = f"{DOCKER_HUB}/{library}{text}"
        ref = parse_ref(text if "://" in text else f"docker://{text}")
        if ref.scheme != "docker":
            raise PullError(f"{text!r} is not an image in a registry (host/repository:tag)")
        name = str(ref).removeprefix("docker://")
        host = ref.store_url.removeprefix("docker://")
        return cls(name, registry_host(host), ref.name, ref.digest or ref.tag or "latest")


@dataclass(frozen=True)
class Document:
    """A manifest, index or config, as it goes into containerd's content store."""

    media_type: str
    digest: str
    data: bytes
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def descriptor(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data)}


@dataclass(frozen=True)
class ResolvedImage:
    """What the registry says the image is: the target its name points at, its manifest,
    the layers and their chain IDs, and the documents to store (index, manifest, config)."""

    target: Document
    manifest_digest: str
    layers: list[dict[str, Any]]
    chain_ids: list[str]
    documents: list[Document]


@dataclass(frozen=True)
class PullResult:
    name: str
    target_digest: str
    manifest_digest: str
    snapshots: tuple[str, ...]  # the layers' chain IDs, bottom first
    roles: tuple[str, ...]
    seconds: float


def pull(ref: str, options: PullOptions = PullOptions()) -> PullResult:
    """Pull ``ref`` lazily into containerd (see the module docstring); ``PullError`` (or an
    ``imagetool.errors`` error for the registry) with a one-line message if it cannot."""
    started = time.monotonic()
    name = ImageName.parse(ref)
    image = resolve(name, options)
    with _Containerd(options) as ctrd, ctrd.lease():
        for doc in image.documents:
            ctrd.write(doc)
        parent = ""
        digests = ",".join(layer["digest"] for layer in image.layers)
        for i, (layer, chain) in enumerate(zip(image.layers, image.chain_ids, strict=True)):
            labels = {
                k: str(v)
                for k, v in (layer.get("annotations") or {}).items()
                if k.startswith(INHERITED_PREFIX)
            }
            labels |= {
                LABEL_TARGET_REF: chain,
                LABEL_CRI_IMAGE_REF: name.name,
                LABEL_CRI_MANIFEST_DIGEST: image.manifest_digest,
                LABEL_CRI_LAYER_DIGEST: layer["digest"],
                LABEL_CRI_IMAGE_LAYERS: digests,
            }
            what = f"layer {i + 1}/{len(image.layers)} {layer['digest']}"
            ctrd.prepare_remote(chain, parent, labels, what)
            log.info("%s: remote snapshot %s", what, chain)
            parent = chain
        ctrd.record_image(name.name, image.target)
    return PullResult(
        name=name.name,
        target_digest=image.target.digest,
        manifest_digest=image.manifest_digest,
        snapshots=tuple(image.chain_ids),
        roles=tuple(str(layer_role(layer)) for layer in image.layers),
        seconds=time.monotonic() - started,
    )


# --- the registry side -------------------------------------------------------------------------


def node_platform() -> str:
    """This machine's platform as containerd matches it (``linux/amd64`` on x86)."""
    return default_platform()


def parse_platform(text: str) -> Platform:
    """``os/arch[/variant]``, arch names as containerd's (``imagetool.platforms``)."""
    try:
        return Platform.parse(text)
    except InvalidReferenceError as e:
        raise PullError(str(e)) from None


def platform_parts(text: str) -> tuple[str, str, str]:
    """(os, arch, variant) of ``os/arch[/variant]``, arch names as containerd's."""
    p = parse_platform(text)
    return p.os, p.architecture, p.variant or ""


def _json(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError:  # not UTF-8, not JSON
        doc = None
    if not isinstance(doc, dict):
        raise PullError(f"{what} is not a JSON object")
    return doc


def resolve(name: ImageName, options: PullOptions) -> ResolvedImage:
    """Read the image from its registry and check that it is a lazyblock block image."""
    platform = options.platform or node_platform()
    want = parse_platform(platform)
    source = {LABEL_DISTRIBUTION_SOURCE + name.host: name.repository}
    documents: list[Document] = []
    with RegistryClient(name.host, name.repository, options.store) as client:
        body, media_type, digest = client.get_manifest(name.reference, MANIFEST_ACCEPT)
        doc = _json(body, f"{name.name}: manifest")
        target = Document(media_type, digest, body, dict(source))
        if media_type in (OCI_INDEX, DOCKER_LIST) or "manifests" in doc:
            entries = [m for m in doc.get("manifests") or [] if isinstance(m, dict)]
            try:
                i, entry = select_platform(
                    list(enumerate(entries)),
                    lambda e: Platform.from_json(e[1].get("platform")),
                    want,
                    name.name,
                )
            except NotFoundError:
                available = available_platforms(
                    entries, lambda e: Platform.from_json(e.get("platform"))
                )
                raise PullError(
                    f"{name.name}: no image for platform {platform} in its index "
                    f"(available: {', '.join(available) or 'none'}; --platform picks one)"
                ) from None
            manifest_digest = check_digest(str(entry.get("digest")))
            target.labels[f"{LABEL_GC_CONTENT}m.{i}"] = manifest_digest
            documents.append(target)
            body, media_type, _ = client.get_manifest(manifest_digest, MANIFEST_ACCEPT)
            doc = _json(body, f"{name.name}: manifest {manifest_digest}")
            manifest = Document(media_type, manifest_digest, body, dict(source))
        else:
            manifest = target
        layers, config_desc = _lazyblock_layers(name.name, doc)
        config_bytes = _read_document(client, config_desc, f"{name.name}: config")
    config = _json(config_bytes, f"{name.name}: config {config_desc['digest']}")
    got_platform = Platform.from_json(config)
    if got_platform is None or not want.matches(got_platform):
        got = "/".join(str(config.get(k)) for k in ("os", "architecture") if config.get(k))
        raise PullError(
            f"{name.name} is an image for {got or 'no platform'}, not {platform} "
            "(--platform pulls another platform's image)"
        )
    chain_ids = _chain_ids(config, len(layers), name.name)
    manifest.labels[f"{LABEL_GC_CONTENT}config"] = config_desc["digest"]
    for i, layer in enumerate(layers):
        manifest.labels[f"{LABEL_GC_CONTENT}l.{i}"] = layer["digest"]
    gc_snapshot = {LABEL_GC_SNAPSHOT + options.snapshotter: chain_ids[-1]}
    documents += [
        manifest,
        Document(config_desc["mediaType"], config_desc["digest"], config_bytes,
                 source | gc_snapshot),
    ]  # fmt: skip
    return ResolvedImage(target, manifest.digest, layers, chain_ids, documents)


def _lazyblock_layers(
    name: str, manifest: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The manifest's layers (each with a lazyblock role) and config descriptor."""
    layers = manifest.get("layers")
    config = manifest.get("config")
    if not isinstance(layers, list) or not layers or not isinstance(config, dict):
        raise PullError(f"{name}: the manifest lists no layers or no config")
    for layer in [config, *layers]:
        if not isinstance(layer, dict) or not isinstance(layer.get("size"), int):
            raise PullError(f"{name}: the manifest has a malformed descriptor")
        check_digest(str(layer.get("digest")))
    roles = [layer_role(layer) for layer in layers]
    if not any(roles):
        raise PullError(
            f"{name} is an ordinary image, not a lazyblock block image: pull it with "
            "'ctr image pull', or convert it with 'imagetool convert' first"
        )
    if set(roles) != {ROLE_BLOB, ROLE_INDEX}:
        raise PullError(
            f"{name}: layers of roles {roles} are not a lazyblock block image (data blobs "
            "and an index); convert the image again with imagetool"
        )
    return layers, config


def _read_document(client: RegistryClient, desc: dict[str, Any], what: str) -> bytes:
    size = desc["size"]
    if size > MAX_DOCUMENT:
        raise PullError(f"{what}: {size} bytes is too large for a config")
    with client.open_blob(desc["digest"]) as f:
        data = f.read(size + 1)  # to the end: the client checks the digest there
    if len(data) != size or sha256_digest(data) != desc["digest"]:
        raise PullError(f"{what}: the registry sent {len(data)} bytes that do not match it")
    return data


def _chain_ids(config: dict[str, Any], count: int, name: str) -> list[str]:
    """containerd's snapshot names for the layers: chain IDs of the config's diff_ids."""
    rootfs = config.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or len(diff_ids) != count:
        raise PullError(f"{name}: the config's rootfs.diff_ids do not match its {count} layers")
    chain: list[str] = []
    for diff_id in diff_ids:
        check_digest(str(diff_id))
        chain.append(diff_id if not chain else sha256_digest(f"{chain[-1]} {diff_id}".encode()))
    return chain


# --- the containerd side -----------------------------------------------------------------------


class _Containerd:
    """containerd's gRPC API, as this pull uses it: one namespace, one lease."""

    def __init__(self, options: PullOptions) -> None:
        self.options = options
        self.stubs = load_client()
        self.channel = grpc.insecure_channel(f"unix://{Path(options.address).absolute()}")
        try:
            grpc.channel_ready_future(self.channel).result(timeout=CONNECT_TIMEOUT)
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise PullError(
                f"cannot reach containerd at {options.address} (is it running? --address "
                "names its socket)"
            ) from None
        self.metadata: list[tuple[str, str]] = [("containerd-namespace", options.namespace)]
        s = self.stubs
        self.content = s.content_grpc.ContentStub(self.channel)
        self.images = s.images_grpc.ImagesStub(self.channel)
        self.leases = s.leases_grpc.LeasesStub(self.channel)
        self.snapshots = s.snapshots_grpc.SnapshotsStub(self.channel)
        self.lease_id = ""

    def __enter__(self) -> _Containerd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()

    def call(
        self,
        what: str,
        method: Callable[..., Any],
        request: Any,
        allow: tuple[grpc.StatusCode, ...] = (),
    ) -> Any:
        """``method(request)`` in the namespace (and lease); None if containerd answers one
        of ``allow``, ``PullError`` for any other error."""
        try:
            return method(request, metadata=self.metadata, timeout=self.options.timeout)
        except grpc.RpcError as e:
            code = e.code()  # type: ignore[attr-defined]
            if code in allow:
                return None
            details = " ".join(str(e.details()).split())  # type: ignore[attr-defined]
            raise PullError(f"containerd: {what}: {code.name}: {details}") from None

    def lease(self) -> _Lease:
        return _Lease(self)

    def write(self, doc: Document) -> None:
        """Store ``doc`` in the content store with its labels (added to what is there if
        containerd has it already)."""
        pb = self.stubs.content
        request = pb.WriteContentRequest(
            action=pb.COMMIT, ref=f"{self.lease_id}-{doc.digest}", total=len(doc.data),
            expected=doc.digest, data=doc.data, labels=doc.labels,
        )  # fmt: skip
        written = self.call(
            f"write {doc.digest}",
            lambda req, **kw: list(self.content.Write(iter([req]), **kw)),
            request,
            allow=(grpc.StatusCode.ALREADY_EXISTS,),
        )
        if written is None and doc.labels:
            info = pb.Info(digest=doc.digest, labels=doc.labels)
            mask = FieldMask(paths=[f"labels.{k}" for k in doc.labels])
            self.call(f"label {doc.digest}", self.content.Update,
                      pb.UpdateRequest(info=info, update_mask=mask))  # fmt: skip

    def prepare_remote(self, chain: str, parent: str, labels: dict[str, str], what: str) -> None:
        """Prepare the layer whose chain ID is ``chain`` as the unpacker does; the snapshotter
        must answer that it exists (committed as a remote snapshot)."""
        pb = self.stubs.snapshots
        sn = self.options.snapshotter
        key = f"extract-{time.time_ns() % 10**9}-{secrets.token_hex(4)} {chain}"
        request = pb.PrepareSnapshotRequest(snapshotter=sn, key=key, parent=parent, labels=labels)
        prepared = self.call(f"prepare {what}", self.snapshots.Prepare, request,
                             allow=(grpc.StatusCode.ALREADY_EXISTS,))  # fmt: skip
        if prepared is not None:
            self.call(f"remove {key}", self.snapshots.Remove,
                      pb.RemoveSnapshotRequest(snapshotter=sn, key=key))  # fmt: skip
            raise PullError(
                f"snapshotter {sn!r} took {what} for an ordinary layer to unpack instead of "
                "mounting it lazily: is it lazyblock's daemon (snapshotter serve) under "
                "[proxy_plugins]? see its log"
            )
        self.call(f"stat {chain}", self.snapshots.Stat,
                  pb.StatSnapshotRequest(snapshotter=sn, key=chain))  # fmt: skip

    def record_image(self, name: str, target: Document) -> None:
        """Create the image record ``name`` -> ``target``, or point an existing one at it."""
        pb = self.stubs.images
        desc = self.stubs.descriptor.Descriptor(
            media_type=target.media_type, digest=target.digest, size=len(target.data)
        )
        image = pb.Image(name=name, target=desc)
        created = self.call(f"create image {name}", self.images.Create,
                            pb.CreateImageRequest(image=image),
                            allow=(grpc.StatusCode.ALREADY_EXISTS,))  # fmt: skip
        if created is None:
            mask = FieldMask(paths=["target"])
            self.call(f"update image {name}", self.images.Update,
                      pb.UpdateImageRequest(image=image, update_mask=mask))  # fmt: skip


class _Lease:
    """A containerd lease for the calls made inside ``with`` (gRPC metadata); ended on the
    way out, whatever happened."""

    def __init__(self, ctrd: _Containerd) -> None:
        self.ctrd = ctrd

    def __enter__(self) -> _Lease:
        ctrd = self.ctrd
        lease_id = f"lazyblock-pull-{secrets.token_hex(8)}"
        expire = (datetime.now(UTC) + LEASE_EXPIRY).strftime("%Y-%m-%dT%H:%M:%SZ")
        pb = ctrd.stubs.leases
        ctrd.call("create a lease", ctrd.leases.Create,
                  pb.CreateRequest(id=lease_id, labels={LABEL_GC_EXPIRE: expire}))  # fmt: skip
        ctrd.lease_id = lease_id
        ctrd.metadata = [*ctrd.metadata, ("containerd-lease", lease_id)]
        return self

    def __exit__(self, *exc: object) -> None:
        ctrd = self.ctrd
        ctrd.metadata = [m for m in ctrd.metadata if m[0] != "containerd-lease"]
        try:
            ctrd.leases.Delete(
                ctrd.stubs.leases.DeleteRequest(id=ctrd.lease_id),
                metadata=ctrd.metadata,
                timeout=CONNECT_TIMEOUT,
            )
        except grpc.RpcError as e:
            log.warning("could not end lease %s (containerd ends it within %s): %s",
                        ctrd.lease_id, LEASE_EXPIRY, e.details())  # type: ignore[attr-defined]  # fmt: skip
