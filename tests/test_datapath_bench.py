"""benchmarks/mount/datapath.py: the data path without FUSE, run on a small image.

It checks that the benchmark reads every byte of the image and reports its parts, not how
fast anything is."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "mount"))

import datapath  # noqa: E402
from smallfiles import setup  # noqa: E402


def test_both_parts_of_a_round_report_cpu_per_gigabyte(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "data").mkdir(parents=True)
    (tree / "data" / "random.bin").write_bytes(os.urandom(9 << 20))
    (tree / "data" / "text.txt").write_text("lazy block images\n" * 400_000)
    (tree / "data" / "zeros.bin").write_bytes(bytes(5 << 20))
    ref = setup(tmp_path / "work", tree, reuse=False)
    out = datapath.run_round(ROOT, ref, tmp_path / "cache")
    assert out["image_GB"] > 0.02  # the tree's ~21 MB, in sectors of 4 MiB
    for part in ("data_path", "receive", "decode_hash"):
        assert out[part] > 0, part
    assert out["overhead"] == out["data_path"] - out["receive"] - out["decode_hash"]
    assert out["data_path_MBps"] > 0
    assert not (tmp_path / "cache").exists()  # each part leaves no cache behind
