"""A mount server takes the hard limit on open descriptors (the cache keeps entries open)."""

from __future__ import annotations

import resource
import subprocess
import sys


def test_a_mount_server_raises_its_soft_descriptor_limit_to_the_hard_one() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = (
        "import resource\n"
        "from snapshotter.cache.sectors import open_file_cap\n"
        "from snapshotter.mount.server import raise_open_file_limit\n"
        "before = open_file_cap()\n"
        "raise_open_file_limit()\n"
        "print(*resource.getrlimit(resource.RLIMIT_NOFILE), before, open_file_cap())\n"
    )

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        preexec_fn=low_limit,
    ).stdout.split()  # fmt: skip
    soft, new_hard, cap_before, cap_after = (int(x) for x in out)
    assert new_hard == hard
    assert soft == min(hard, 1 << 20)
    assert cap_before == 32 and cap_after > cap_before  # an eighth of the limit, then more
