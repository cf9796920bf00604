"""``open_source``: a source spec string to a ``SourceImage``."""

from __future__ import annotations

from imagetool.errors import InvalidReferenceError
from imagetool.platforms import Platform
from imagetool.sources._image import ANY_PLATFORM, SourceImage
from imagetool.stores.base import StoreOptions

# StoreOptions is frozen, so one shared default is safe.
_DEFAULT_OPTIONS = StoreOptions()
SPEC_FORMS = "oci:PATH[:TAG], docker-archive:PATH, docker://HOST[:PORT]/REPO[:TAG|@DIGEST]"


def open_source(
    spec: str, *, platform: str | None = None, options: StoreOptions = _DEFAULT_OPTIONS
) -> SourceImage:
    """Open one platform image of a source.

    ``platform`` ("os/arch[/variant]") picks the image from a multi-platform index; the
    default is the running machine's (linux/amd64 on x86). Given explicitly, it must also
    match a single-platform image's config; ``ANY_PLATFORM`` takes an index's first image
    (``SourceImage.index_platforms`` then lists them all). ``options`` are used by the
    registry source.
    """
    if platform is not None and platform != ANY_PLATFORM:
        Platform.parse(platform)  # fail early on a malformed platform
    transport, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise InvalidReferenceError(f"invalid source {spec!r}: expected one of {SPEC_FORMS}")
    if transport == "oci":
        from imagetool.sources._layout import OciLayoutSource, split_layout_spec

        path, tag = split_layout_spec(rest)
        return OciLayoutSource(path, tag, platform, spec)
    if transport == "docker-archive":
        from imagetool.sources._archive import DockerArchiveSource, split_archive_spec

        path, ref = split_archive_spec(rest)
        return DockerArchiveSource(path, ref, platform, spec)
    if transport == "docker" and rest.startswith("//"):
        from imagetool.sources._registry import RegistrySource, parse_registry_spec

        host, repo, reference = parse_registry_spec(rest[2:], spec)
        return RegistrySource(host, repo, reference, platform, options, spec)
    raise InvalidReferenceError(f"invalid source {spec!r}: expected one of {SPEC_FORMS}")
