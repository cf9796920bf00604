"""Source OCI images: reading the images that imagetool converts.

``open_source(spec)`` opens one platform image from an OCI image layout (``oci:PATH[:TAG]``),
a ``docker save`` tarball (``docker-archive:PATH``) or a registry
(``docker://HOST[:PORT]/REPO[:TAG|@DIGEST]``), and returns a ``SourceImage``: its manifest
digest, config, platform and layers (bottom first). ``open_layer`` streams a layer as an
uncompressed tar and verifies it against its digests as it goes.

Errors (all from ``imagetool.errors``): a malformed source is ``InvalidSourceError`` (with
``DigestMismatchError`` and ``UnsupportedMediaTypeError`` below it); a path, tag or platform
that does not exist is ``NotFoundError``; a blob an image refers to but its source lacks is
``MissingBlobError``, which is both; an unparsable spec is ``InvalidReferenceError``.
"""

from imagetool.sources._image import (
    ANY_PLATFORM,
    Layer,
    MissingBlobError,
    SourceImage,
    default_platform,
)
from imagetool.sources._spec import open_source

__all__ = [
    "ANY_PLATFORM",
    "Layer",
    "MissingBlobError",
    "SourceImage",
    "default_platform",
    "open_source",
]
