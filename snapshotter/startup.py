"""What a lazyblock process of its own leaves out of its start-up.

httpx imports its command line (pygments, rich) and httpcore imports trio whenever those
packages happen to be installed (other tools bring them: typer, moto...), although lazyblock
uses neither: about 90 ms of imports, a fifth of a node's first mount, on a machine that has
them. The processes lazyblock owns and that talk to registries (the ``snapshotter`` command, a
mount server, the fork server) call ``skip_unused_imports`` before anything imports httpx, so
that those imports fail at once and httpx and httpcore go on without them, as they do where
the packages are not installed. A library caller's process is never changed.
"""

from __future__ import annotations

import sys

# Top-level packages imported only for optional integrations of httpx/httpcore.
UNUSED = ("trio", "rich", "pygments")


def skip_unused_imports() -> None:
    """Make ``import trio`` (and the others in ``UNUSED``) fail in this process, unless one
    is already imported."""
    for name in UNUSED:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError
