"""benchmarks/mount/run.py's measuring parts: what a cold pass's CPU is charged to, and the
condition that keeps a VM's host from taking memory back during a pass. Not how fast
anything is."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "mount"))

import run  # noqa: E402


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_all_but_store_charges_the_reader_and_leaves_out_the_store_and_others() -> None:
    meter = run.CpuMeter({}).start()
    _burn(0.3)
    cpu = meter.stop(1.0)
    assert cpu["reader"] >= 0.25
    for part in ("kernel", "others", "steal", "unaccounted"):
        assert cpu[part] >= 0.0, part
    # The machine's busy time is split: what is not the node's (other processes, steal)
    # is taken off, and the reader is in what is left.
    assert cpu["all_but_store"] == pytest.approx(cpu["machine"] - cpu["steal"] - cpu["others"])
    assert cpu["all_but_store"] >= cpu["reader"] - 0.02  # ticks of 10 ms


def test_a_named_store_process_is_not_part_of_all_but_store() -> None:
    # This process named as the store: its CPU comes off all_but_store.
    meter = run.CpuMeter({"registry": run.os.getpid()}).start()
    _burn(0.3)
    cpu = meter.stop(1.0)
    assert cpu["registry"] >= 0.25
    assert cpu["all_but_store"] <= cpu["machine"] - cpu["registry"] + 1e-9


def test_reporting_is_held_for_the_block_and_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    order = tmp_path / "page_reporting_order"
    order.write_text("9\n")
    monkeypatch.setattr(run, "REPORTING_ORDER", order)
    orders = max(len(line.split()) - 4 for line in Path("/proc/buddyinfo").read_text().splitlines())
    with run.reporting_held(True):
        assert int(order.read_text()) == orders  # no free block is of that order
    assert order.read_text() == "9"
    with pytest.raises(RuntimeError), run.reporting_held(True):
        raise RuntimeError("a pass that fails")
    assert order.read_text() == "9"
    with run.reporting_held(False):
        assert order.read_text() == "9"


def test_a_held_run_backs_all_free_memory_but_the_headroom() -> None:
    assert run.MemoryPrep(5 << 30).bytes_to_back() == 5 << 30
    assert run.MemoryPrep().bytes_to_back() == 0
    free = next(
        int(line.split()[1]) << 10
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemFree:")
    )
    held = run.MemoryPrep(hold_reporting=True).bytes_to_back()
    assert abs(held - (free - run.FREE_HEADROOM)) < 512 << 20  # MemFree moves meanwhile
