"""The ``snapshotter`` command line: options become a ``Config``, errors become exit codes.

Every command reads the configuration file (``--config``, default
``/etc/lazyblock/config.toml``); every key in it can be overridden with
``--set section.key=value`` and the common ones have their own flags.

Exit codes are every lazyblock command's (``lazyblock.cli``): 0 success, 1 ``check`` found a
problem that stops lazy pulls, 2 usage error, 3 any snapshotter or imagetool error (one line:
``snapshotter: error: <Type>: <message>``), 130 interrupted.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from imagetool.errors import ImageToolError
from lazyblock.cli import EXIT_CHECK_FAILED, ToolGroup
from snapshotter import systemd
from snapshotter.config import format_size
from snapshotter.errors import SnapshotterError

log = logging.getLogger("snapshotter")


def _config_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--config, --set and the flags for the most used keys."""

    @click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False, path_type=Path),
        help="Configuration file [default: /etc/lazyblock/config.toml].",
    )
    @click.option(
        "--set",
        "sets",
        multiple=True,
        metavar="SECTION.KEY=VALUE",
        help="Override any configuration key (repeatable).",
    )
    @click.option("--cache-dir", help="Sector cache directory (cache.dir).")
    @click.option("--cache-size", help="Sector cache cap, e.g. 20GiB (cache.size).")
    @click.option("--state-dir", help="Mount state directory (state.dir).")
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from snapshotter.config import load_config

        overrides = _overrides(kwargs.pop("sets"))
        for flag, key in (("cache_dir", "cache.dir"), ("cache_size", "cache.size"),
                          ("state_dir", "state.dir")):  # fmt: skip
            value = kwargs.pop(flag)
            if value is not None:
                overrides[key] = value
        for flag, key in (("prefetch", "prefetch.enabled"),
                          ("background_fetch", "prefetch.background_fetch"),
                          ("backing", "mount.backing"), ("local_copy", "mount.local_copy"),
                          ("address", "snapshotter.address"),
                          ("root", "snapshotter.root"),
                          ("insecure", "snapshotter.insecure_registries")):  # fmt: skip
            if flag in kwargs:
                value = kwargs.pop(flag)
                if value not in (None, ()):
                    overrides[key] = value
        kwargs["config"] = load_config(kwargs.pop("config_path"), overrides)
        return func(*args, **kwargs)

    return wrapper


def _overrides(sets: tuple[str, ...]) -> dict[str, object]:
    """``--set SECTION.KEY=VALUE`` options as ``load_config`` takes them."""
    overrides: dict[str, object] = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq:
            raise click.BadParameter(f"{item!r} is not SECTION.KEY=VALUE", param_hint="--set")
        overrides[key.strip()] = value.strip()
    return overrides


@click.group("snapshotter", cls=ToolGroup, errors=(SnapshotterError, ImageToolError))
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
@click.version_option(package_name="lazyblock")
@click.pass_context
def cli(ctx: click.Context, verbose: int) -> None:
    """Mount lazyblock block images lazily, and inspect the mounts."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    ctx.obj = {"log_level": level}


@cli.command(name="mount")
@click.argument("ref")
@click.argument("mountpoint", type=click.Path(file_okay=False, path_type=Path))
@click.option("--prefetch/--no-prefetch", default=None,
              help="Warm the cache with the image's startup profile.")  # fmt: skip
@click.option("--background-fetch", is_flag=True, default=None,
              help="Then fetch the whole image in the background.")  # fmt: skip
@click.option("--backing", type=click.Choice(["auto", "file", "loop"]),
              help="erofs on the FUSE file directly (file) or through a loop device.")  # fmt: skip
@click.option("--local-copy/--no-local-copy", default=None,
              help="Once the image is whole in the cache, have its loop device read a copy "
                   "of it past FUSE (mount.local_copy).")  # fmt: skip
@click.option("--foreground", is_flag=True, help="Serve from this process until unmounted.")
@_config_options
@click.pass_context
def mount_cmd(ctx: click.Context, ref: str, mountpoint: Path, foreground: bool, config) -> None:  # noqa: ANN001
    """Mount image REF read-only at MOUNTPOINT; returns once the tree is browsable.

    REF is any store reference imagetool accepts (/dir/NAME:TAG, s3://..., docker://...).
    """
    from snapshotter.mount import api

    started = time.monotonic()
    if foreground:

        def ready(doc: dict[str, Any]) -> bool:
            if doc.get("ok"):
                click.echo(f"mounted {ref} at {mountpoint} in {time.monotonic() - started:.3f}s")
                systemd.notify("READY=1")
            else:
                click.echo(f"snapshotter: error: {doc['type']}: {doc['error']}", err=True)
            return True  # this process is the one that asked

        sys.exit(api.run_foreground(ref, mountpoint, config.mount, ready))
    # No fork server yet (the node's first mount): this process, which has imported much of
    # what the server needs, forks itself into it rather than starting a new interpreter.
    info = api.mount(
        ref, mountpoint, config.mount, log_level=ctx.find_root().obj["log_level"], fork_self=True
    )
    log.info("mounted in %.3fs", time.monotonic() - started)
    click.echo(f"{info.mountpoint} {info.index_digest} pid={info.pid} backing={info.backing}")


@cli.command(name="umount")
@click.argument("mountpoint", type=click.Path(file_okay=False, path_type=Path))
@click.option("-l", "--lazy", is_flag=True, help="Detach now even if busy.")
@_config_options
def umount_cmd(mountpoint: Path, lazy: bool, config) -> None:  # noqa: ANN001
    """Unmount MOUNTPOINT and stop its server (also cleans up after a dead one)."""
    from snapshotter.mount import api

    api.unmount(mountpoint, config.mount, lazy=lazy)


@cli.command(name="upgrade-mounts")
@click.argument("mountpoints", nargs=-1, type=click.Path(file_okay=False, path_type=Path))
@click.option("--reconfigure", is_flag=True,
              help="Serve with this command's configuration, not each mount's own.")  # fmt: skip
@_config_options
@click.pass_context
def upgrade_mounts_cmd(
    ctx: click.Context,
    mountpoints: tuple[Path, ...],
    reconfigure: bool,
    config,  # noqa: ANN001
) -> None:
    """Replace the server of each mount (all live mounts if none is named) with a new
    process of the installed version, under running readers: each takes its mount's FUSE
    connection over from the mount's holder and retires the old server; no read fails.
    Each keeps its mount's configuration and credentials unless --reconfigure."""
    from snapshotter.mount import api

    if not mountpoints:
        mountpoints = tuple(
            m.mountpoint for m in api.list_mounts(config.mount) if m.alive and m.phase == "ready"
        )
    failed = 0
    for mountpoint in mountpoints:
        started = time.monotonic()
        try:
            old = [m.pid for m in api.list_mounts(config.mount)
                   if m.mountpoint == mountpoint.absolute()]  # fmt: skip
            info = api.replace(mountpoint, config.mount, reconfigure=reconfigure,
                               log_level=ctx.find_root().obj["log_level"])  # fmt: skip
        except SnapshotterError as e:
            failed += 1
            click.echo(f"{mountpoint}: {type(e).__name__}: {e}", err=True)
            continue
        click.echo(f"{info.mountpoint}: pid {old[0] if old else '?'} -> {info.pid} "
                   f"in {time.monotonic() - started:.3f}s")  # fmt: skip
    if failed:
        sys.exit(1)


@cli.command()
@click.argument("mountpoint", required=False, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_config_options
def status(mountpoint: Path | None, as_json: bool, config) -> None:  # noqa: ANN001
    """Mounts, cache use and per-mount statistics."""
    from snapshotter.cache.sectors import cache_usage, local_copies
    from snapshotter.mount import api

    mounts = []
    for info in api.list_mounts(config.mount):
        if mountpoint is not None and info.mountpoint != mountpoint.absolute():
            continue
        doc = info.to_dict()
        if info.alive and info.phase == "ready":
            try:
                doc["stats"] = api.stats(info.mountpoint, config.mount)
            except SnapshotterError as e:
                doc["stats_error"] = str(e)
        mounts.append(doc)
    entries, used = cache_usage(config.mount.cache_dir)
    copies, copied = local_copies(config.mount.cache_dir)
    cache = {
        "dir": str(config.mount.cache_dir),
        "entries": entries,
        "bytes": used,
        "max_bytes": config.mount.cache_size,
        "local_copies": copies,
        "local_copy_bytes": copied,
    }
    if as_json:
        click.echo(json.dumps({"mounts": mounts, "cache": cache}, indent=2))
        return
    click.echo(f"cache {cache['dir']}: {entries} sectors, {format_size(used)} of "
               f"{format_size(cache['max_bytes'])}"
               + (f"; {copies} local cop{'y' if copies == 1 else 'ies'}, {format_size(copied)}"
                  if copies else ""))  # fmt: skip
    if not mounts:
        click.echo("no mounts")
    for m in mounts:
        state = "ready" if m["alive"] and m["phase"] == "ready" else (
            m["phase"] if m["alive"] else
            "restarting (its holder starts a new server)" if m["held"] else
            "DEAD (run umount)")  # fmt: skip
        click.echo(f"{m['mountpoint']}: {m['ref']} [{state}] pid {m['pid']} via {m['backing']}")
        s = m.get("stats")
        if s:
            f = s["fetch"]
            lat = f["fetch_latency"]
            hits, misses = f["cache_hits"], f["cache_misses"]
            ratio = hits / (hits + misses) if hits + misses else 0.0
            click.echo(
                f"  fetched {f['sectors_fetched']} sectors ({format_size(f['bytes_fetched'])}) in "
                f"{f['store_requests']} requests; cache hits {hits} ({ratio:.0%}); "
                f"latency p50 {_ms(lat['p50'])} p90 {_ms(lat['p90'])} p99 {_ms(lat['p99'])}"
            )
            click.echo(
                f"  errors: fetch {f['fetch_errors']}, store {f['store_errors']}, checksum "
                f"{f['checksum_errors']}, reads {s['reads']['errors']}; in flight "
                f"{f['inflight']}; prefetch {s['prefetch']['mode']} "
                f"{s['prefetch']['fetched']}/{s['prefetch']['planned']}"
                + (" streaming the image" if s["prefetch"].get("streaming") else "")
                + (
                    f", {n} large files read whole"
                    if (n := s["prefetch"].get("files_streamed"))
                    else ""
                )
            )
            click.echo(
                f"  stalled on the network: {f['stall_late_seconds']:.2f}s for sectors asked "
                f"for too late, {f['stall_missing_seconds']:.2f}s for sectors not asked for"
            )
            copy = s.get("local_copy") or {}
            if copy.get("state", "off") != "off":
                click.echo(
                    f"  local copy: {copy['state']}"
                    + (f", {copy['path']} (made in {copy['seconds']:.1f}s)" if copy["path"] else "")
                )
            for src in s.get("sources", []):
                backoff = src["backoff_seconds"]
                click.echo(
                    f"  {src['role']} {src['url']}: {src['requests']} requests, "
                    f"{format_size(src['bytes'])}; errors {src['errors']}, timeouts "
                    f"{src['timeouts']}, rejected {src['rejected']}, not found "
                    f"{src['not_found']}, skipped {src['skipped']}"
                    + (f"; backing off {backoff:.0f}s" if backoff > 0 else "")
                )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}ms"


@cli.command()
@click.argument("mountpoint", type=click.Path(file_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              required=True, help="Profile file (imagetool convert --profile).")  # fmt: skip
@_config_options
def profile(mountpoint: Path, output: Path, config) -> None:  # noqa: ANN001
    """Write the files read through MOUNTPOINT so far, in first-access order, with the byte
    ranges read of each file read only in part (imagetool convert --profile)."""
    from snapshotter.mount import api

    recorded = api.profile(mountpoint, config.mount)
    output.write_text(recorded.render())
    partly = sum(1 for e in recorded.entries if e.ranges is not None)
    log.info("%d files (%d read in part) written to %s", len(recorded), partly, output)


@cli.group()
def cache() -> None:
    """Inspect and trim the node's sector cache."""


@cache.command(name="ls")
@_config_options
def cache_ls(config) -> None:  # noqa: ANN001
    """List cache entries (checksum, bytes, last use), least recently used first; then the
    local copies of whole images (``local/NAME``, bytes, when made, the loop device that
    reads it or "-"; ``mount.local_copy``)."""
    from snapshotter.cache.sectors import cache_entries, local_copy_files

    for checksum, size, used in cache_entries(config.mount.cache_dir):
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(used))
        click.echo(f"{checksum} {size:>9} {stamp}")
    for path, size, made, device in local_copy_files(config.mount.cache_dir):
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(made))
        click.echo(f"local/{os.path.basename(path)} {size:>9} {stamp} {device or '-'}")


@cache.command(name="gc")
@_config_options
def cache_gc(config) -> None:  # noqa: ANN001
    """Evict least recently used entries down to the cache's size cap; drop leftovers."""
    from snapshotter.cache.sectors import SectorCache

    c = SectorCache(config.mount.cache_dir, config.mount.cache_size)
    freed = c.gc()
    click.echo(f"freed {format_size(freed)}; {len(c)} entries, {format_size(c.usage())} in use")


@cache.command(name="clear")
@_config_options
def cache_clear(config) -> None:  # noqa: ANN001
    """Remove every cache entry (running mounts refetch what they need)."""
    from snapshotter.cache.sectors import SectorCache

    c = SectorCache(config.mount.cache_dir, config.mount.cache_size)
    c.clear()
    click.echo("cache cleared")


@cli.command()
@click.option("--listen", help="host:port for the Prometheus endpoint (metrics.listen).")
@_config_options
def metrics(listen: str | None, config) -> None:  # noqa: ANN001
    """Serve Prometheus metrics of every mount on this node (runs until stopped)."""
    from snapshotter.prometheus import serve_forever

    serve_forever(listen or config.metrics_listen, config.mount)


@cli.command()
@click.option("--address", type=click.Path(path_type=Path),
              help="Unix socket to serve on (snapshotter.address).")  # fmt: skip
@click.option("--root", type=click.Path(file_okay=False, path_type=Path),
              help="Snapshot metadata and layers (snapshotter.root).")  # fmt: skip
@click.option("--insecure-registry", "insecure", multiple=True, metavar="HOST:PORT",
              help="A registry reached over plain HTTP (repeatable; loopback only).")  # fmt: skip
@click.option("-v", "--verbose", count=True, help="Debug logging (the daemon logs INFO).")
@_config_options
def serve(verbose: int, config) -> None:  # noqa: ANN001
    """Serve containerd's snapshots API (a [proxy_plugins] snapshotter)."""
    logging.basicConfig(
        level=[logging.INFO, logging.DEBUG][min(verbose, 1)],
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    # Imported here: gRPC and its stubs cost the other commands (``mount`` above all) a
    # tenth of a second at start.
    from snapshotter.containerd import daemon

    daemon.serve(config)


@cli.command()
@click.option("--listen", type=click.Path(dir_okay=False, path_type=Path),
              help="Its Unix socket [default: <state.dir>/launcher.sock].")  # fmt: skip
@click.option("--check", is_flag=True,
              help="Do not serve: say whether a launcher of this code listens (exit 0) or "
                   "not (exit 1).")  # fmt: skip
@_config_options
def launcher(listen: Path | None, check: bool, config) -> None:  # noqa: ANN001
    """Start mount servers for daemons in pods: the node launcher (runs until stopped).

    Run it as a node service (systemd/lazyblock-launcher.service), outside any pod: the
    mount servers it starts live in its cgroup and namespaces, so deleting or updating the
    daemon's pod does not kill them. It exits when lazyblock's code changes on disk, for
    the service manager to start the new one."""
    logging.basicConfig(level=logging.INFO, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    from snapshotter.mount import launcher as node_launcher

    path = listen or node_launcher.default_socket(config.mount.state_dir)
    if check:
        ours = node_launcher.code_version()
        try:
            info = node_launcher.hello(path)
        except node_launcher.LauncherError as e:
            click.echo(f"no launcher: {e}")
            sys.exit(1)
        same = info.get("code") == ours
        click.echo(f"launcher pid {info.get('pid')}, lazyblock {info.get('version')}, code "
                   f"{info.get('code')} ({'ours' if same else f'ours is {ours}'})")  # fmt: skip
        sys.exit(0 if same else 1)
    sys.exit(node_launcher.serve(path))


@cli.command()
@click.argument("ref")
@click.option("-a", "--address", type=click.Path(dir_okay=False, path_type=Path),
              default="/run/containerd/containerd.sock", show_default=True,
              envvar="CONTAINERD_ADDRESS", help="containerd's socket.")  # fmt: skip
@click.option("-n", "--namespace", default="default", show_default=True,
              envvar="CONTAINERD_NAMESPACE", help="containerd namespace.")  # fmt: skip
@click.option("--snapshotter", "snapshotter_name", default="lazyblock", show_default=True,
              help="containerd's name for lazyblock's proxy snapshotter.")  # fmt: skip
@click.option("--platform", help="os/arch[/variant] to pull [default: this machine's].")
@click.option("--plain-http", is_flag=True, help="The registry speaks plain HTTP (loopback).")
def pull(
    ref: str, address: Path, namespace: str, snapshotter_name: str, platform: str | None,
    plain_http: bool,
) -> None:  # fmt: skip
    """Pull block image REF lazily into containerd, for 'ctr run --snapshotter lazyblock'.

    For containerd 1.6/1.7, whose 'ctr image pull' cannot pull a block image lazily (it
    fails with "failed to get stream processor for
    application/vnd.oci.image.layer.lazyblock..."); works with 2.x too. REF is an image
    name as ctr takes it (host[:port]/repository[:tag|@digest]); the snapshotter daemon
    mounts the image.
    """
    from imagetool.stores.base import StoreOptions
    from snapshotter.containerd.pull import PullOptions
    from snapshotter.containerd.pull import pull as lazy_pull

    options = PullOptions(
        address=address, namespace=namespace, snapshotter=snapshotter_name, platform=platform,
        store=StoreOptions(plain_http=plain_http),
    )  # fmt: skip
    result = lazy_pull(ref, options)
    click.echo(
        f"pulled {result.name} lazily in {result.seconds:.2f}s: manifest "
        f"{result.manifest_digest}, {len(result.snapshots)} layers as remote snapshots of "
        f"{snapshotter_name!r} (top {result.snapshots[-1]})"
    )


@cli.command()
@click.option("--containerd-config", type=click.Path(dir_okay=False, path_type=Path),
              default="/etc/containerd/config.toml", show_default=True,
              help="containerd's configuration file.")  # fmt: skip
@click.option("--containerd-address", type=click.Path(dir_okay=False, path_type=Path),
              help="containerd's socket [default: its config's [grpc] address, else "
              "/run/containerd/containerd.sock].")  # fmt: skip
@click.option("--snapshotter", "snapshotter_name", default="lazyblock", show_default=True,
              help="containerd's name for lazyblock's proxy snapshotter.")  # fmt: skip
@click.option("--registry", "registries", multiple=True, metavar="HOST|REF",
              help="Also check a registry, or resolve an image in it (repeatable).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="lazyblock's config [default: /etc/lazyblock/config.toml].")  # fmt: skip
@click.option("--set", "sets", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override a key of lazyblock's configuration (repeatable).")  # fmt: skip
def check(
    containerd_config: Path, containerd_address: Path | None, snapshotter_name: str,
    registries: tuple[str, ...], as_json: bool, config_path: Path | None, sets: tuple[str, ...],
) -> int:  # fmt: skip
    """Check this node for lazy pulls: containerd, the daemon, the kernel, directories.

    One line per check: 'ok', 'warn' (works, or one client path is not lazy) or 'FAIL' (a
    lazy pull cannot work), each with its fix. Exits 1 if any check failed. Reads
    containerd's configuration (version 2 for 1.6/1.7, 3 for 2.x) and asks the running
    containerd and lazyblock's daemon over their sockets; changes nothing.
    """
    from snapshotter.containerd.nodecheck import CheckOptions, check_node, failed

    options = CheckOptions(
        containerd_config=containerd_config, containerd_address=containerd_address,
        snapshotter=snapshotter_name, config_path=config_path, overrides=_overrides(sets),
        registries=registries,
    )  # fmt: skip
    checks = check_node(options)
    if as_json:
        doc = {"ok": not failed(checks), "checks": [c.to_dict() for c in checks]}
        click.echo(json.dumps(doc, indent=2))
    else:
        for c in checks:
            label = {"ok": "ok", "warn": "warn", "fail": "FAIL"}[c.status]
            fix = f" \N{EM DASH} fix: {c.fix}" if c.fix and c.status != "ok" else ""
            click.echo(f"{label:<4} {c.message}{fix}")
    return EXIT_CHECK_FAILED if failed(checks) else 0


cli.add_command(check, name="doctor")


def main() -> None:
    from snapshotter.startup import skip_unused_imports

    skip_unused_imports()
    cli.main()


if __name__ == "__main__":
    main()
