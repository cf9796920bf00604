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
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from imagetool.erofs.writer import plan_erofs, plan_erofs_regions
from imagetool.errors import FormatError, ProfileError
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
)
from imagetool.pack import iter_sectors, pack
from imagetool.readahead import ReadAhead
from imagetool.sources import SourceImage, open_source
from imagetool.stores import open_store, parse_ref
from imagetool.stores.base import StoreOptions
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
    profile: tuple[str, ...] = ()  # paths in first-access order; their data goes first
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


PROFILE_MAX_LINE = 4096  # PATH_MAX: no path in an image is longer


def read_profile(path: Path) -> tuple[str, ...]:
    """A profile file: one absolute path per line; blank lines and ``#`` comments ignored.
    ``ProfileError`` for a file that is not such a list (unreadable, not UTF-8 text, a
    line that cannot be a path): better refused at conversion than laid out wrong."""
    try:
        text = path.read_bytes().decode()
    except OSError as e:
        raise ProfileError(f"cannot read profile {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"profile {path} is not a UTF-8 text file (one path per line)") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "\0" in line or len(line) > PROFILE_MAX_LINE:
            raise ProfileError(f"profile {path}, line {n}: not a path: {line[:60]!r}")
        out.append("/" + line.lstrip("/"))
    return tuple(out)


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
    check_sector_size(options.sector_size)
    if options.format_version not in FORMAT_VERSIONS:
        raise FormatError(f"no block image format version {options.format_version}")
    if not 0.0 <= options.raw_saving < 1.0:
        raise FormatError(f"raw saving must be in [0, 1), got {options.raw_saving}")
    ref = parse_ref(dest)
    if ref.digest:
        from imagetool.errors import InvalidReferenceError

        raise InvalidReferenceError(f"destination must name a tag, not a digest: {dest}")
    with (
        open_store(ref, options.store) as store,
        open_source(source_spec, platform=options.platform, options=options.store) as source,
        tempfile.TemporaryDirectory(prefix="lazyblock-convert-", dir=options.tmpdir) as tmp,
    ):
        work = Path(tmp)
        with open(work / "spool", "w+b") as spool:
            sink = SpoolSink(spool)
            tree = build_tree(source, sink, progress)
            spool.flush()
            if options.format_version == 1:
                plan = plan_erofs(tree, order=options.profile)
            else:
                plan = plan_erofs_regions(
                    tree, sink.layers, options.sector_size, order=options.profile
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
        digest = store.publish(ref.tag or "latest", index.to_blob())
        log.info("published %s:%s as %s", ref.name, ref.tag, digest)
        return ConvertResult(digest, index)


def _prefetch_order(
    files: Sequence[FileExtent], options: ConvertOptions, metadata_sectors: int, count: int
) -> tuple[int, ...]:
    """Sectors of the profile's files, in first-access order (metadata is fetched at mount)."""
    if not options.profile:
        return ()
    by_path = {f.path: f for f in files}
    absent = [p for p in options.profile if p not in by_path]
    if absent:  # a profile of another image, or of an older version of this one
        log.warning("profile: %d of its %d paths are not files with data in this image "
                    "(first: %s); they are ignored", len(absent), len(options.profile),
                    absent[0])  # fmt: skip
    order: list[int] = []
    seen = set(range(metadata_sectors))
    for path in options.profile:
        f = by_path.get(path)
        if f is None:
            continue
        first = f.offset // options.sector_size
        last = (f.offset + f.length - 1) // options.sector_size
        for s in range(first, min(last, count - 1) + 1):
            if s not in seen:
                seen.add(s)
                order.append(s)
    return tuple(order)


def _run_config(config: dict) -> dict:
    run = config.get("config") or {}
    return {k: run[k] for k in RUN_CONFIG_KEYS if k in run}
