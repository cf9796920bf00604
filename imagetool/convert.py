"""Convert an OCI image into a block image and publish it to a store.

Pipeline, each stage streaming:

1. read every layer once, front to back, applying it to the in-memory tree; file contents go
   to a spool file on local disk (``imagetool.tree``);
2. lay the tree out as EROFS: metadata first, then file data, in regions per source layer
   (format version 2) or in layout order (version 1) (``erofs.writer``);
3. assemble sectors from the plan and the spool, compress and checksum them in parallel into
   local blob files, one per region (``imagetool.pack``);
4. upload the data blobs (those the store already holds, from another image with the same
   layers, are not sent again), then publish the index under the tag: the one commit point.
   A failure anywhere before it leaves no index behind, only unreferenced temporary files,
   which are removed.

``convert_platforms`` does this for several platforms of a source's image index (``convert
--platform all`` or a comma list), storing each platform's image untagged, then publishes a
platform index naming them under the tag, the commit point there (``imagetool.format``).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from imagetool.erofs.writer import plan_erofs, plan_erofs_regions
from imagetool.errors import FormatError, NotFoundError
from imagetool.format import (
    BLOB_MEDIA_TYPE,
    DEFAULT_RAW_SAVING,
    DEFAULT_SECTOR_SIZE,
    DEFAULT_ZSTD_LEVEL,
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    Blob,
    FileExtent,
    Index,
    check_sector_size,
    sha256_digest,
)
from imagetool.pack import iter_sectors, pack
from imagetool.platforms import Platform, parse_platform_list, select_platform
from imagetool.profile import Profile
from imagetool.readahead import ReadAhead
from imagetool.sources import ANY_PLATFORM, SourceImage, open_source
from imagetool.stores import ImageRef, open_store, parse_ref
from imagetool.stores.base import Store, StoreOptions
from imagetool.tree import ContentSink, SpoolSink, Tree, apply_layer

log = logging.getLogger(__name__)

# Parts of the source image config that describe how to run it; carried into the index.
RUN_CONFIG_KEYS = (
    "User", "ExposedPorts", "Env", "Entrypoint", "Cmd", "Volumes", "WorkingDir", "Labels",
    "StopSignal", "ArgsEscaped",
)  # fmt: skip


@dataclass(frozen=True)
class ConvertOptions:
    sector_size: int = DEFAULT_SECTOR_SIZE
    level: int = DEFAULT_ZSTD_LEVEL  # zstd level; 3 compresses at hundreds of MB/s per core
    platform: str | None = None
    # files in first-access order: their data goes first, and the sectors of what the start
    # read of them are the prefetch order
    profile: Profile = Profile()
    workers: int | None = None  # compression threads; default: one per CPU
    format_version: int = FORMAT_VERSION
    # A sector whose zstd form saves less than this share of its size is stored raw (format
    # version 2 only): see DEFAULT_RAW_SAVING.
    raw_saving: float = DEFAULT_RAW_SAVING
    tmpdir: Path | None = None  # where the spool and blob are staged
    store: StoreOptions = field(default_factory=StoreOptions)


@dataclass(frozen=True)
class ConvertResult:
    index_digest: str
    index: Index


Progress = Callable[[str, int, int | None], None]  # (stage, bytes done delta, total)
# An image index's entries for what is not an image to run (buildx's attestation manifests).
UNKNOWN = "unknown"


def build_tree(source: SourceImage, sink: ContentSink, progress: Progress | None = None) -> Tree:
    """Apply every layer of ``source`` in order; file contents go to ``sink``."""
    tree = Tree()
    on_read = (lambda size: progress("read", size, None)) if progress is not None else None
    for n, layer in enumerate(source.layers):
        sink.begin_layer(layer.digest)
        with source.open_layer(layer) as stream, ReadAhead(stream, on_read) as ahead:
            apply_layer(tree, ahead, sink, f"{n} ({layer.digest[:19]})")  # type: ignore[arg-type]
    return tree


def convert(
    source_spec: str,
    dest: str,
    options: ConvertOptions = ConvertOptions(),
    progress: Progress | None = None,
) -> ConvertResult:
    """Convert one platform image of ``source_spec`` (``options.platform``, default the
    running machine's) and publish it as ``dest``."""
    ref = _check(dest, options)
    with (
        open_store(ref, options.store) as store,
        open_source(source_spec, platform=options.platform, options=options.store) as source,
    ):
        index = _convert_image(source, store, options, progress)
        digest = store.publish(ref.tag or "latest", index.to_blob())
        log.info("published %s:%s as %s", ref.name, ref.tag, digest)
        return ConvertResult(digest, index)


@dataclass(frozen=True)
class MultiConvertResult:
    """A multi-platform conversion: the platform index's digest (a registry's image index
    manifest digest) and each platform's image, in the index's order."""

    index_digest: str
    images: tuple[tuple[str, ConvertResult], ...]  # (platform, its image)
    single: bool = False  # the source is one image, published as it is (no platform index)


def convert_platforms(
    source_spec: str,
    dest: str,
    platforms: str,
    options: ConvertOptions = ConvertOptions(),
    progress: Progress | None = None,
) -> MultiConvertResult:
    """Convert several platforms of a source's image index (``platforms``: ``all`` or a
    comma list of ``os/arch[/variant]``), each into its own block image, and publish a
    platform index naming them as ``dest`` (``imagetool.format``). Every platform asked
    for must be in the source (``NotFoundError`` before anything is converted); the index
    is published last, once every image is stored, so a failure publishes nothing under the
    tag. A source that is one image, not an index, is converted as that one image with
    ``all`` (published as an ordinary block image, ``single``); a list must name its
    platform."""
    wanted = parse_platform_list(platforms)
    ref = _check(dest, options)
    with open_source(source_spec, platform=ANY_PLATFORM, options=options.store) as probe:
        available = list(probe.index_platforms)
        single = None if available else probe.platform
    if single is not None:  # not an index: its one image
        if wanted is not None and (
            len(wanted) != 1 or not wanted[0].matches(Platform.parse(single))
        ):
            raise NotFoundError(
                f"{source_spec} is one image for {single}, not an index of "
                f"{', '.join(map(str, wanted))}"
            )
        log.warning("%s is one image (%s), not an image index: converting it alone",
                    source_spec, single)  # fmt: skip
        one = convert(source_spec, dest, replace(options, platform=single), progress)
        return MultiConvertResult(one.index_digest, ((single, one),), single=True)
    entries = [Platform.parse(p) for p in available]
    if wanted is None:  # not buildx's attestations (unknown/unknown), as containerd skips them
        chosen = [str(p) for p in entries if UNKNOWN not in (p.os, p.architecture)]
    else:
        picks = {str(select_platform(entries, lambda p: p, w, source_spec)) for w in wanted}
        chosen = [str(p) for p in entries if str(p) in picks]  # the source index's order
    images: list[tuple[str, ConvertResult]] = []
    platform_entries = []
    with open_store(ref, options.store) as store:
        for platform in chosen:
            with open_source(source_spec, platform=platform, options=options.store) as source:
                log.info("converting %s (%s)", platform, source.manifest_digest)
                index = _convert_image(source, store, options, _per_platform(progress, platform))
            blob = index.to_blob()
            platform_entries.append(store.put_image(blob))
            images.append((platform, ConvertResult(sha256_digest(blob), index)))
        digest = store.publish_index(ref.tag or "latest", platform_entries)
        log.info("published %s:%s as platform index %s (%s)", ref.name, ref.tag, digest,
                 ", ".join(chosen))  # fmt: skip
    return MultiConvertResult(digest, tuple(images))


def _per_platform(progress: Progress | None, platform: str) -> Progress | None:
    """Progress of one platform's conversion: stages named ``STAGE:PLATFORM``."""
    if progress is None:
        return None
    report = progress
    return lambda stage, n, total: report(f"{stage}:{platform}", n, total)


def _check(dest: str, options: ConvertOptions) -> ImageRef:
    """The destination reference, and the options checked, before anything is read."""
    check_sector_size(options.sector_size)
    if options.format_version not in FORMAT_VERSIONS:
        raise FormatError(f"no block image format version {options.format_version}")
    if not 0.0 <= options.raw_saving < 1.0:
        raise FormatError(f"raw saving must be in [0, 1), got {options.raw_saving}")
    ref = parse_ref(dest)
    if ref.digest:
        from imagetool.errors import InvalidReferenceError

        raise InvalidReferenceError(f"destination must name a tag, not a digest: {dest}")
    return ref


def _convert_image(
    source: SourceImage, store: Store, options: ConvertOptions, progress: Progress | None
) -> Index:
    """Convert one source image and store its data blobs; returns its index (not stored:
    the caller publishes it under a tag or in a platform index)."""
    with tempfile.TemporaryDirectory(prefix="lazyblock-convert-", dir=options.tmpdir) as tmp:
        work = Path(tmp)
        with open(work / "spool", "w+b") as spool:
            sink = SpoolSink(spool)
            tree = build_tree(source, sink, progress)
            spool.flush()
            if options.format_version == 1:
                plan = plan_erofs(tree, order=options.profile.paths)
            else:
                plan = plan_erofs_regions(
                    tree, sink.layers, options.sector_size, order=options.profile.paths
                )
            del tree, sink
            total = plan.size

            def report(n: int) -> None:
                if progress is not None:
                    progress("pack", n, total)

            packed = pack(
                iter_sectors(plan, spool.fileno(), options.sector_size),
                plan.regions,
                options.sector_size,
                work,
                level=options.level,
                raw_saving=options.raw_saving if options.format_version > 1 else 0.0,
                workers=options.workers,
                progress=report,
            )
        metadata_sectors = -(-len(plan.metadata) // options.sector_size)
        index = Index(
            image_size=plan.size,
            sector_size=options.sector_size,
            sectors=packed.sectors,
            metadata_sectors=metadata_sectors,
            blobs=tuple(
                Blob(b.digest, b.size, b.region.role, b.region.layer) for b in packed.blobs
            ),
            prefetch=_prefetch_order(plan.files, options, metadata_sectors, len(packed.sectors)),
            manifest_digest=source.manifest_digest,
            platform=source.platform,
            config=_run_config(source.config),
            files=plan.files,
            version=options.format_version,
        )
        for blob in packed.blobs:
            store.put_blob(blob.digest, blob.path, BLOB_MEDIA_TYPE)
        return index


def _prefetch_order(
    files: Sequence[FileExtent], options: ConvertOptions, metadata_sectors: int, count: int
) -> tuple[int, ...]:
    """Sectors of what the start read of the profile's files (whole files, or the ranges
    the profile gives), in first-access order (metadata is fetched at mount)."""
    profile = options.profile
    if not profile:
        return ()
    by_path = {f.path: f for f in files}
    absent = [p for p in profile.paths if p not in by_path]
    if absent:  # a profile of another image, or of an older version of this one
        log.warning(
            "profile: %d of its %d paths are not files with data in this image (first: %s); "
            "they are ignored", len(absent), len(profile), absent[0],
        )  # fmt: skip
    order: list[int] = []
    seen = set(range(metadata_sectors))
    for entry in profile.entries:
        f = by_path.get(entry.path)
        if f is None:
            continue
        for start, end in entry.spans(f.length):
            first = (f.offset + start) // options.sector_size
            last = (f.offset + end - 1) // options.sector_size
            for s in range(first, min(last, count - 1) + 1):
                if s not in seen:
                    seen.add(s)
                    order.append(s)
    return tuple(order)


def _run_config(config: dict) -> dict:
    run = config.get("config") or {}
    return {k: run[k] for k in RUN_CONFIG_KEYS if k in run}
