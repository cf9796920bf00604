"""Media types the sources understand, and what each one means.

Manifests, indexes and configs come in the OCI and the Docker schema2 flavour; layers are tar
streams, uncompressed, gzip or zstd, and may be "non-distributable" (foreign) layers, which we
read like any other when the blob is present. Anything else is refused with
``UnsupportedMediaTypeError`` rather than guessed at.
"""

from __future__ import annotations

from imagetool.errors import UnsupportedMediaTypeError

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"

OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar"  # docker-archive, uncompressed
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"

MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
CONFIG_TYPES = (OCI_CONFIG, DOCKER_CONFIG)
# What we send as Accept when asking a registry for a manifest.
ACCEPT_MANIFESTS = (OCI_INDEX, DOCKER_LIST, OCI_MANIFEST, DOCKER_MANIFEST)

# Layer media type -> compression (None: a plain tar).
LAYER_COMPRESSION: dict[str, str | None] = {
    OCI_LAYER: None,
    OCI_LAYER_GZIP: "gzip",
    OCI_LAYER_ZSTD: "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": None,
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": "zstd",
    DOCKER_LAYER: None,
    DOCKER_LAYER_GZIP: "gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
    # Not in the Docker spec, but what docker/containerd label zstd layers with when they
    # write a schema2 manifest.
    "application/vnd.docker.image.rootfs.diff.tar.zstd": "zstd",
}


def layer_compression(media_type: str, what: str) -> str | None:
    """The compression a layer media type announces; ``what`` names the layer in errors."""
    try:
        return LAYER_COMPRESSION[media_type]
    except KeyError:
        raise UnsupportedMediaTypeError(
            f"{what}: unsupported layer media type {media_type!r}"
        ) from None


def check_config_type(media_type: str, what: str) -> None:
    if media_type not in CONFIG_TYPES:
        raise UnsupportedMediaTypeError(
            f"{what}: unsupported config media type {media_type!r} (not a container image)"
        )
