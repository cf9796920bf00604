"""Storage backends for block images, chosen by URL.

    /path/to/store/NAME:TAG, file:///...   DirStore       (the embedded default)
    s3://bucket/prefix/NAME:TAG             S3Store        (boto3)
    docker://host[:port]/repo/path:TAG      RegistryStore  (OCI distribution spec)

``parse_ref`` parses a reference, ``open_store`` opens the store it names, bound to its image
name; ``Store.resolve_ref`` turns the reference's tag or digest into an index digest.
"""

from __future__ import annotations

from imagetool.errors import InvalidReferenceError
from imagetool.stores.base import Store, StoreOptions
from imagetool.stores.refs import DEFAULT_TAG, ImageRef, absolute_ref, parse_ref

__all__ = [
    "DEFAULT_TAG",
    "DirStore",
    "ImageRef",
    "RegistryStore",
    "S3Store",
    "Store",
    "StoreOptions",
    "absolute_ref",
    "open_store",
    "parse_ref",
]


def open_store(ref: ImageRef | str, options: StoreOptions | None = None) -> Store:
    """The store a reference names, bound to the reference's image name."""
    if isinstance(ref, str):
        ref = parse_ref(ref)
    options = options or StoreOptions()
    url = ref.store_url
    if url.startswith("s3://"):
        from imagetool.stores.s3 import S3Store

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        return S3Store(bucket, prefix, ref.name, options)
    if url.startswith("docker://"):
        from imagetool.stores.registry import RegistryStore

        return RegistryStore(url.removeprefix("docker://"), ref.name, options)
    if "://" in url:
        raise InvalidReferenceError(f"unknown store {url!r}")
    from imagetool.stores.dir import DirStore

    return DirStore(url, ref.name)


def __getattr__(name: str) -> type[Store]:
    # The backends import boto3 and httpx; load them only when asked for.
    if name == "DirStore":
        from imagetool.stores.dir import DirStore

        return DirStore
    if name == "S3Store":
        from imagetool.stores.s3 import S3Store

        return S3Store
    if name == "RegistryStore":
        from imagetool.stores.registry import RegistryStore

        return RegistryStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
