"""What a mount's start-up imports: the ``snapshotter mount`` command and a mount server load
none of the heavy packages they do not use (each check in a fresh interpreter), and a process
of lazyblock's own skips httpx's and httpcore's optional integrations."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# Packages for other stores or other commands: the S3 store's boto3, the containerd
# service's gRPC and protobuf, the metrics exporter's and imagetool's.
NOT_FOR_A_MOUNT = (
    "boto3", "botocore", "grpc", "google.protobuf", "prometheus_client", "tqdm", "aiohttp",
    "kubernetes",
)  # fmt: skip


def _loaded_after(code: str, names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` a fresh interpreter has imported after running ``code``."""
    script = textwrap.dedent(code) + textwrap.dedent(f"""
        import json, sys
        print(json.dumps([n for n in {list(names)!r} if sys.modules.get(n) is not None]))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd="/"
    )
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_mount_command_imports_nothing_a_mount_does_not_use() -> None:
    loaded = _loaded_after(
        """
        from snapshotter import cli
        from snapshotter.mount import api as mount
        cli.cli.get_command(None, "mount")
        """,
        (*NOT_FOR_A_MOUNT, "httpx"),
    )
    assert loaded == []  # httpx too: the command itself talks to no store


def test_a_mount_server_on_a_registry_or_directory_store_imports_neither_boto3_nor_grpc() -> None:
    loaded = _loaded_after(
        """
        from snapshotter.startup import skip_unused_imports
        skip_unused_imports()
        from snapshotter.mount import server as mount_server
        from imagetool.stores import open_store
        open_store("docker://127.0.0.1:9/some/image:v1").close()
        open_store("/nonexistent/store/image:v1")
        """,
        (*NOT_FOR_A_MOUNT, "httpx"),
    )
    assert loaded == ["httpx"]


def test_lazyblock_processes_skip_httpx_optional_integrations() -> None:
    from snapshotter.startup import UNUSED

    loaded = _loaded_after(
        """
        from snapshotter.startup import skip_unused_imports
        skip_unused_imports()
        import httpx, httpcore._sync.connection_pool
        httpx.Client().close()
        """,
        UNUSED,
    )
    assert loaded == []


def test_skipping_leaves_an_imported_package_alone() -> None:
    loaded = _loaded_after(
        """
        import sys, types
        sys.modules["trio"] = types.ModuleType("trio")  # a caller that uses it already
        from snapshotter.startup import skip_unused_imports
        skip_unused_imports()
        import trio
        """,
        ("trio",),
    )
    assert loaded == ["trio"]
