"""The ``imagetool`` command line: options become config objects, errors become exit codes.

Exit codes are every lazyblock command's (``lazyblock.cli``): 0 success, 1 a check failed
(verify), 2 usage error, 3 any imagetool error (one line: ``imagetool: error: <Type>:
<message>``), 130 interrupted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import stat
import sys
import time
from pathlib import Path
from types import FrameType

import click

from imagetool.errors import ImageToolError
from lazyblock.cli import EXIT_CHECK_FAILED, ToolGroup

log = logging.getLogger("imagetool")

_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``4MiB``, ``4M``, ``65536`` -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise click.BadParameter(f"not a size: {text!r} (e.g. 4MiB, 512KiB, 1048576)")
    unit = (m.group(2) or "B").upper()[0]
    return int(m.group(1)) << {"B": 0, "K": 10, "M": 20, "G": 30}[unit]


class SizeType(click.ParamType):
    name = "size"

    def convert(self, value, param, ctx):  # noqa: ANN001, ANN201
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except click.BadParameter as e:
            self.fail(str(e), param, ctx)


def _store_options(ctx: click.Context):  # noqa: ANN202
    from imagetool.stores.base import StoreOptions

    obj = ctx.find_root().obj or {}
    return StoreOptions(plain_http=obj.get("plain_http", False), timeout=obj.get("timeout", 30.0))


@click.group("imagetool", cls=ToolGroup, errors=(ImageToolError,))
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
@click.option(
    "--plain-http", is_flag=True, help="Talk to registries over plain HTTP (loopback tests only)."
)
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Network timeout.")
@click.version_option(package_name="lazyblock")
@click.pass_context
def cli(ctx: click.Context, verbose: int, plain_http: bool, timeout: float) -> None:
    """Convert OCI images into lazyblock block images and inspect them."""
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)],
        format="%(levelname)s %(name)s: %(message)s",
    )
    ctx.obj = {"plain_http": plain_http, "timeout": timeout}


@cli.command()
@click.argument("source")
@click.argument("dest")
@click.option("--sector-size", type=SizeType(), default="4MiB", show_default=True)
@click.option("--level", type=click.IntRange(1, 22), default=3, show_default=True,
              help="zstd compression level.")  # fmt: skip
@click.option(
    "--platform",
    help="os/arch[/variant] to pick from an image index (default: this machine's); 'all' "
    "or a comma list (linux/amd64,linux/arm64) converts each platform into its own block "
    "image and publishes an index of them as DEST.",
)
@click.option("--profile", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Startup profile (snapshotter profile): files in first-access order, laid "
              "out first; what the start read of them is prefetched first.")  # fmt: skip
@click.option("--workers", type=click.IntRange(1, 256), help="Compression threads.")
@click.option(
    "--format-version",
    type=click.Choice(["1", "2"]),
    default="2",
    show_default=True,
    help="Block image format: 2 lays data out per source layer (images that share "
    "layers share blobs and sectors); 1 for readers that predate it.",
)
@click.option(
    "--raw-saving",
    type=click.FloatRange(0.0, 1.0, max_open=True),
    help="Store a sector raw when zstd saves less than this share of it (format 2; "
    "default 0.10, 0 never).",
)
@click.option("--tmpdir", type=click.Path(file_okay=False, path_type=Path),
              help="Where to stage the conversion (needs about the image size free).")  # fmt: skip
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.pass_context
def convert(
    ctx: click.Context,
    source: str,
    dest: str,
    sector_size: int,
    level: int,
    platform: str | None,
    profile: Path | None,
    workers: int | None,
    format_version: str,
    raw_saving: float | None,
    tmpdir: Path | None,
    quiet: bool,
) -> None:
    """Convert SOURCE into a block image published as DEST; prints the index digest.

    With --platform all (or a list), prints the digest of the index of platforms, and each
    platform's image digest on stderr.

    \b
    SOURCE: oci:PATH[:TAG] | docker-archive:PATH | docker://HOST/REPO[:TAG]
    DEST:   STORE/NAME[:TAG], STORE = /dir | file:///dir | s3://bucket/prefix | docker://host
    """
    from imagetool import profile as profiles
    from imagetool.convert import ConvertOptions, convert_platforms
    from imagetool.convert import convert as do_convert
    from imagetool.platforms import is_platform_list

    more = {"raw_saving": raw_saving} if raw_saving is not None else {}
    options = ConvertOptions(
        **more,
        sector_size=sector_size,
        level=level,
        platform=None if is_platform_list(platform) else platform,
        profile=profiles.read(profile) if profile else profiles.Profile(),
        workers=workers,
        format_version=int(format_version),
        tmpdir=tmpdir,
        store=_store_options(ctx),
    )
    started = time.monotonic()
    if is_platform_list(platform):
        assert platform is not None
        with _Progress(disabled=quiet) as progress:
            multi = convert_platforms(source, dest, platform, options, progress=progress)
        for name, image in multi.images:
            click.echo(f"{name} {image.index_digest}", err=True)
        if multi.single:
            click.echo(f"{source} is one image, not an index: published it alone", err=True)
        click.echo(multi.index_digest)
        return
    with _Progress(disabled=quiet) as progress:
        result = do_convert(source, dest, options, progress=progress)
    idx = result.index
    log.info(
        "%d sectors, %s image -> %s stored in %d blobs in %.1fs",
        idx.sector_count, _human(idx.image_size), _human(sum(b.size for b in idx.blobs)),
        len(idx.blobs), time.monotonic() - started,
    )  # fmt: skip
    click.echo(result.index_digest)


class _Progress:
    """tqdm bars on a terminal (stderr); nothing otherwise."""

    def __init__(self, disabled: bool) -> None:
        self.disabled = disabled or not sys.stderr.isatty()
        self.bars: dict[str, object] = {}

    def __call__(self, stage: str, n: int, total: int | None) -> None:
        if self.disabled:
            return
        from tqdm import tqdm

        bar = self.bars.get(stage)
        if bar is None:
            for other in self.bars.values():
                other.close()  # type: ignore[attr-defined]
            kind, _, platform = stage.partition(":")  # convert --platform all: per platform
            desc = {"read": "reading layers", "pack": "compressing"}.get(kind, kind)
            desc += f" ({platform})" if platform else ""
            bar = self.bars[stage] = tqdm(
                total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                file=sys.stderr, dynamic_ncols=True,
            )  # fmt: skip
        bar.update(n)  # type: ignore[attr-defined]

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        for bar in self.bars.values():
            bar.close()  # type: ignore[attr-defined]


@cli.command()
@click.argument("ref")
@click.option("--index", "whole_index", is_flag=True,
              help="Print the whole index (its canonical JSON, uncompressed) instead.")  # fmt: skip
@click.option("--platform", help="os/arch[/variant] to read from a multi-platform image "
              "(default: this machine's).")  # fmt: skip
@click.pass_context
def inspect(ctx: click.Context, ref: str, whole_index: bool, platform: str | None) -> None:
    """Print a JSON summary of a block image (of a multi-platform image: this machine's
    platform's, or --platform's)."""
    from imagetool.image import open_image

    with open_image(ref, _store_options(ctx), platform) as img:
        idx = img.index
        if whole_index:
            click.echo(idx.to_bytes().decode())
            return
        summary = _summary(ref, img.digest, idx)
    click.echo(json.dumps(summary, indent=2))


def _summary(ref: str, digest: str, idx) -> dict:  # noqa: ANN001
    """``inspect``'s document: the image, and each data blob with the region it holds (the
    source layer it came from) and its sectors."""
    stored = [s for s in idx.sectors if not s.is_zero]
    blobs = [
        {"digest": b.digest, "size": b.size, "role": b.role, "source_layer": b.layer or None,
         "sectors": 0, "raw_sectors": 0, "image_bytes": 0}
        for b in idx.blobs
    ]  # fmt: skip
    for n, s in enumerate(idx.sectors):
        if not s.is_zero:
            blobs[s.blob]["sectors"] += 1
            blobs[s.blob]["raw_sectors"] += s.raw
            blobs[s.blob]["image_bytes"] += idx.sector_span(n)[1]
    stored_bytes = sum(b.size for b in idx.blobs)
    return {
        "reference": ref,
        "index_digest": digest,
        "format_version": idx.version,
        "filesystem": "erofs",
        "image_size": idx.image_size,
        "sector_size": idx.sector_size,
        "sectors": idx.sector_count,
        "stored_sectors": len(stored),
        "raw_sectors": sum(1 for s in stored if s.raw),
        "zero_sectors": idx.sector_count - len(stored),
        "metadata_sectors": idx.metadata_sectors,
        "prefetch_sectors": len(idx.prefetch),
        "stored_bytes": stored_bytes,
        "blobs": blobs,
        "compression_ratio": round(idx.image_size / stored_bytes, 3) if stored_bytes else None,
        "files": len(idx.files),
        "source": {"manifest_digest": idx.manifest_digest, "platform": idx.platform},
        "config": idx.config,
    }


@cli.command(name="ls")
@click.argument("ref")
@click.argument("path", default="/")
@click.option("-R", "--recursive", is_flag=True, help="List subdirectories too.")
@click.option("--platform", help="os/arch[/variant] to read from a multi-platform image "
              "(default: this machine's).")  # fmt: skip
@click.pass_context
def ls_cmd(ctx: click.Context, ref: str, path: str, recursive: bool, platform: str | None) -> None:
    """List a directory of the image (like ls -l), read through the index."""
    from imagetool.image import open_image

    with open_image(ref, _store_options(ctx), platform) as img:
        fs = img.image.filesystem()
        node = fs.lookup(_abs(path))
        if not stat.S_ISDIR(node.mode):
            click.echo(_ls_line(fs, node, os.path.basename(path.rstrip("/")) or path))
            return
        if recursive:
            for sub, inode in fs.walk(_abs(path)):
                click.echo(_ls_line(fs, inode, sub))
            return
        for name, nid, _ in fs.listdir(node):
            click.echo(_ls_line(fs, fs.inode(nid), name))


def _abs(path: str) -> str:
    return "/" + path.strip("/")


def _ls_line(fs, inode, name: str) -> str:  # noqa: ANN001
    mtime = time.strftime("%Y-%m-%d %H:%M", time.gmtime(inode.mtime))
    if stat.S_ISCHR(inode.mode) or stat.S_ISBLK(inode.mode):
        size = f"{os.major(inode.rdev)}, {os.minor(inode.rdev)}"
    else:
        size = str(inode.size)
    line = f"{stat.filemode(inode.mode)} {inode.nlink:>3} {inode.uid:>5} {inode.gid:>5} "
    line += f"{size:>10} {mtime} {name}"
    if stat.S_ISLNK(inode.mode):
        line += " -> " + fs.readlink(inode)
    return line


@cli.command()
@click.argument("ref")
@click.argument("path")
@click.option("--platform", help="os/arch[/variant] to read from a multi-platform image "
              "(default: this machine's).")  # fmt: skip
@click.pass_context
def cat(ctx: click.Context, ref: str, path: str, platform: str | None) -> None:
    """Write a file of the image to stdout (symlinks inside the image are followed)."""
    from imagetool.image import open_image

    with open_image(ref, _store_options(ctx), platform) as img:
        fs = img.image.filesystem()
        inode = _follow(fs, _abs(path))
        if not stat.S_ISREG(inode.mode):
            raise click.UsageError(f"{path} is not a regular file")
        out = click.get_binary_stream("stdout")
        for chunk in fs.iter_content(inode):
            out.write(chunk)


def _follow(fs, path: str, limit: int = 40):  # noqa: ANN001, ANN202
    """Resolve ``path`` inside the image, following symlinks like the kernel would."""
    parts = [p for p in path.split("/") if p]
    resolved: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = "/" + "/".join([*resolved, part])
        inode = fs.lookup(candidate)
        if stat.S_ISLNK(inode.mode):
            hops += 1
            if hops > limit:
                raise click.UsageError(f"too many levels of symbolic links: {path}")
            target = fs.readlink(inode)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in target.split("/") if p] + parts
            continue
        resolved.append(part)
    return fs.lookup("/" + "/".join(resolved))


@cli.command()
@click.argument("ref")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--platform", help="os/arch[/variant] to read from a multi-platform image "
              "(default: this machine's).")  # fmt: skip
@click.pass_context
def raw(ctx: click.Context, ref: str, out: Path, platform: str | None) -> None:
    """Write the uncompressed filesystem image to OUT (for fsck.erofs or a loop mount)."""
    from imagetool.image import open_image

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open_image(ref, _store_options(ctx), platform) as img, open(tmp, "wb") as f:
            for n, data in img.image.iter_all():
                if img.index.sectors[n].is_zero:
                    f.seek(len(data), os.SEEK_CUR)  # leave a hole
                else:
                    f.write(data)
            f.truncate(img.index.image_size)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


@cli.command()
@click.argument("ref")
@click.option("--against", "source", help="Source image to compare every file with.")
@click.option("--platform", help="os/arch[/variant] to read from a multi-platform image "
              "(default: this machine's), and of the source to compare with.")  # fmt: skip
@click.pass_context
def verify(ctx: click.Context, ref: str, source: str | None, platform: str | None) -> None:
    """Check every sector's checksum, and with --against every file against the source."""
    from imagetool.image import open_image
    from imagetool.sources import open_source
    from imagetool.verify import VerifyReport, compare_tree, source_tree, verify_sectors

    options = _store_options(ctx)
    report = VerifyReport()
    with open_image(ref, options, platform) as img:
        verify_sectors(img.image, report)
        if source:
            with open_source(source, platform=platform or img.index.platform or None,
                             options=options) as src:  # fmt: skip
                compare_tree(img.image.filesystem(), source_tree(src), report)
    for line in report.bad_sectors + report.bad_blobs + report.differences[:50]:
        click.echo(f"FAIL {line}", err=True)
    if len(report.differences) > 50:
        click.echo(f"... and {len(report.differences) - 50} more differences", err=True)
    summary = f"{report.sectors} sectors checked, {len(report.bad_sectors)} bad; "
    summary += f"{report.blobs} blobs checked, {len(report.bad_blobs)} bad"
    if source:
        summary += f"; {report.files} entries compared, {len(report.differences)} differ"
    click.echo(summary)
    if not report.ok:
        sys.exit(EXIT_CHECK_FAILED)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: the one place errors become messages and exit codes."""
    # SIGTERM/SIGHUP (a job stopped, a terminal closed) unwind like Ctrl-C, so a conversion
    # removes its staging files and publishes nothing; SIGINT too, even when a shell started
    # us as a background job with it ignored.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _interrupt)
    cli.main(args=argv)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
