"""The benchmark's pure parts: READY lines, summaries, targets, the report and image sizing.
No root; the chart needs matplotlib (a benchmark dependency CI installs)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import support

from benchmarks import proccpu
from benchmarks.coldstart import image, run


def test_parse_ready():
    assert run.parse_ready("loading...") is None
    assert run.parse_ready("") is None
    f = run.parse_ready("READY torch=2.13.0+cpu read_bytes=123 rchar=456 junk\n")
    assert f == {"torch": "2.13.0+cpu", "read_bytes": "123", "rchar": "456"}
    assert run.parse_ready("READY") == {}


def test_summarize():
    assert run.summarize([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert run.summarize([1.0, 2.0])["median"] == 1.5


def _scen(median: float, registry: int | None = None, read: int | None = None) -> dict:
    runs = [{"seconds": median, "registry_bytes": registry, "wire_bytes": registry,
             "read_bytes": read, "phases_s": {}}]  # fmt: skip
    return run.summarize_runs(runs, image_bytes=1000)


def test_targets_met_and_missed():
    scen = {
        "full-pull": _scen(50.0, 900),
        "lazy-profile": _scen(6.0, 140),
        "local": _scen(3.0, 0, 100),
    }
    t = run.evaluate_targets(scen)
    assert [x["met"] for x in t] == [True, False, True]
    assert "8.3x faster" in t[0]["measured"]
    assert "+3.00s" in t[1]["measured"]
    assert "1.40x" in t[2]["measured"]


def test_targets_not_evaluated_say_why():
    scen = {
        "full-pull": _scen(50.0, 900),
        "local": _scen(3.0, 0, 100),
        "lazy-profile": {"status": "not-run", "reason": "snapshotter.mount.api is not there"},
    }
    t = run.evaluate_targets(scen)
    assert [x["met"] for x in t] == [None, None, None]
    assert "snapshotter.mount.api is not there" in t[0]["measured"]


def _results() -> dict:
    return {
        "image": {
            "tag": "tiny-8m",
            "compressed_bytes": 9_000_000,
            "rootfs_bytes": 10_000_000,
            "weights_bytes": 8_000_000,
            "layers": 2,
            "kind": "tiny",
        },  # fmt: skip
        "runs": 1,
        "presets": {
            "1g-1ms": {
                "preset": {"name": "1g-1ms", "rate_mbit": 1000.0, "rtt_ms": 1.0},
                "measured_rtt_ms": 1.4,
                "scenarios": {
                    "full-pull": _scen(5.0, 9_000_000, 0),
                    "lazy": {"status": "not-run", "reason": "no snapshotter"},
                    "local": _scen(1.0, 0, 10_000_000),
                },
                "targets": [{"target": "x", "met": False, "measured": "because"}],
                "notes": ["a note"],
            }
        },
    }


def test_markdown_table():
    md = run.markdown_table(_results())
    assert "### 1g-1ms: 1000 Mbit/s, 1 ms RTT (measured TCP connect 1.40 ms)" in md
    assert "| full-pull | 5.00 s | 5.00 s | 5.00 s | 9.0 MB | 0.0 MB | - | - |" in md
    assert "| lazy | not run: no snapshotter |" in md
    assert "| x | **no** | because |" in md
    assert "- a note" in md


def test_floor_is_the_larger_of_the_local_run_and_the_transfer_plus_one_second():
    scen = {
        "local": _scen(3.0, 0, 100),
        "lazy": _scen(9.0, 500_000_000),
        "lazy-profile": _scen(5.0, 400_000_000),
    }
    rate = {"bytes_per_s": 100_000_000, "bytes": 1, "seconds": 1, "connections": 4}
    floor = run.physical_floor(scen, rate)  # 400 MB at 100 MB/s: 4 s, more than local
    assert floor["seconds"] == 5.0 and floor["transfer_s"] == 4.0
    assert floor["fetched_bytes"] == 400_000_000  # the profiled start's bytes, not lazy's
    t = run.floor_targets(scen, floor)
    assert [(x["target"], x["met"], x["ratio"]) for x in t] == [
        ("lazy-profile <= 1.15 x floor", True, 1.0),
        ("lazy <= 1.5 x floor", False, 1.8),
    ]
    for r in scen["lazy-profile"]["runs"]:  # what the workload read, not what streamed
        r["snapshotter"] = {"touched_stored_bytes": 300_000_000}
    assert run.physical_floor(scen, rate)["fetched_bytes"] == 300_000_000
    slow = {**rate, "bytes_per_s": 1_000_000_000}  # a fast link: the local run decides
    assert run.physical_floor(scen, slow)["seconds"] == 4.0
    assert run.physical_floor(scen, None) is None
    assert [x["met"] for x in run.floor_targets(scen, None)] == [None, None]


def test_the_table_shows_the_floor_and_the_stalls():
    res = _results()
    pr = res["presets"]["1g-1ms"]
    lazy = _scen(4.0, 100_000_000)
    lazy["runs"][0]["snapshotter"] = {"stall_late_s": 0.5, "stall_missing_s": 1.25}
    pr["scenarios"]["lazy"] = lazy
    pr["store_rate"] = {"bytes_per_s": 50_000_000, "bytes": 256 << 20, "seconds": 5.4,
                        "connections": 4}  # fmt: skip
    pr["floor"] = run.physical_floor(pr["scenarios"], pr["store_rate"])
    pr["floor_targets"] = run.floor_targets(pr["scenarios"], pr["floor"])
    md = run.markdown_table(res)
    assert "| lazy | 4.00 s | 4.00 s | 4.00 s | 100.0 MB | - | 1.33 | 0.50 / 1.25 s |" in md
    assert "Floor 3.00 s = max(local 1.00 s, 100.0 MB needed ÷ 400 Mbit/s = 2.00 s) + 1 s" in md
    assert "| lazy <= 1.5 x floor | yes | 4.00 s / 3.00 s = 1.33 |" in md


def _snapshot(busy: float, idle: float, processes: dict) -> proccpu.Snapshot:
    """pid -> (comm, ppid, CPU-seconds[, start time; default the pid])."""
    table = {}
    for pid, (comm, ppid, seconds, *started) in processes.items():
        table[pid] = proccpu.ProcessCpu(comm, ppid, seconds, 0.0, (started or [pid])[0])
    return proccpu.Snapshot(busy, idle, 0.0, table)


def test_the_cpu_of_a_start_is_split_by_role():
    before = _snapshot(100.0, 50.0, {
        2: ("kthreadd", 0, 0.0),
        10: ("kworker/0:1-events", 2, 1.0),
        20: ("containerd", 1, 5.0),
        30: ("containerd-shim", 1, 0.5),
        40: ("docker-registry", 1, 2.0),
        50: ("lazyblock-fork", 1, 0.2),
    })  # fmt: skip
    after = _snapshot(110.0, 52.0, {
        2: ("kthreadd", 0, 0.0),
        10: ("kworker/0:1-loop0", 2, 1.5),  # a kernel worker's name follows its work
        20: ("containerd", 1, 5.25),
        30: ("containerd-shim", 1, 0.75),
        31: ("python3", 30, 0.0),  # the container's init, its work done by its child
        32: ("python3", 31, 4.0),
        40: ("docker-registry", 1, 3.0),
        50: ("lazyblock-fork", 1, 0.2),
        51: ("lazyblock-mount", 50, 2.0),
    })  # fmt: skip
    cpu = proccpu.cpu_between(before, after, run.start_role)
    assert cpu == {
        "busy": 10.0, "idle": 2.0, "steal": 0.0, "kernel": 0.5, "containerd": 0.5,
        "workload": 4.0, "registry": 1.0, "mount_server": 2.0, "unaccounted": 2.0,
    }  # fmt: skip
    # a number taken by another process since counts that process from zero
    reused = _snapshot(111.0, 52.0, {40: ("sleep", 1, 0.5, 9999)})
    assert proccpu.cpu_between(after, reused, run.start_role)["other"] == 0.5
    # a process that was there before reaps a child: the child may have run before, so it
    # is not counted; a new process's reaped children are
    later = proccpu.Snapshot(112.0, 52.0, 0.0, {
        **after.processes,
        20: dataclasses.replace(after.processes[20], seconds=5.5, children=3.0),
        32: dataclasses.replace(after.processes[32], seconds=4.5, children=1.0),
    })  # fmt: skip
    cpu = proccpu.cpu_between(after, later, run.start_role)
    assert cpu["containerd"] == 0.25 and cpu["workload"] == 0.5
    assert proccpu.cpu_between(before, later, run.start_role)["workload"] == 5.5


def test_the_report_shows_the_cpu_of_each_start():
    res = _results()
    pr = res["presets"]["1g-1ms"]
    res["host"] = {"cpus": 2}
    runs = [
        {"seconds": s, "registry_bytes": 1, "wire_bytes": 1, "read_bytes": None, "phases_s": {},
         "cpu_s": {"busy": busy, "idle": 4.0 - busy, "workload": w, "mount_server": m}}
        for s, busy, w, m in ((2.0, 3.0, 2.0, 0.5), (2.0, 3.5, 2.5, 1.0), (2.0, 4.0, 3.0, 0.25))
    ]  # fmt: skip
    pr["scenarios"]["lazy"] = run.summarize_runs(runs, image_bytes=1000)
    assert pr["scenarios"]["lazy"]["cpu_s"] == {
        "busy": 3.5, "idle": 0.5, "mount_server": 0.5, "workload": 2.5,
    }  # fmt: skip
    md = run.markdown_table(res)
    assert "| lazy | 3.50 | 0.50 | 0.00 | 2.50 | 0.50 | 0.00 |" in md
    assert md.split("| lazy | 3.50 |")[1].splitlines()[0].endswith("| 12% |")


def test_write_results(tmp_path):
    support.require(importlib.util.find_spec("matplotlib") is not None, "needs matplotlib")
    run.write_results(_results(), tmp_path)
    assert json.loads((tmp_path / "latest.json").read_text())["runs"] == 1
    assert (tmp_path / "latest.md").read_text().startswith("Image `tiny-8m`")
    assert (tmp_path / "latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sizes():
    assert image.parse_size("512MiB") == 512 << 20
    assert image.parse_size("6G") == 6 << 30
    assert image.parse_size("1.5GiB") == 3 << 29
    assert image.parse_size("4096") == 4096
    with pytest.raises(ValueError):
        image.parse_size("lots")
    assert image.size_label(512 << 20) == "512m"
    assert image.size_label(6 << 30) == "6g"
    assert image.size_label(1000) == "1000"


def test_shard_sizes():
    row = image.ROW * 2
    assert image.shard_sizes(512 << 20) == [512 << 20]
    sizes = image.shard_sizes((5 << 30) + (3 << 20) + 5)
    assert sizes[:5] == [1 << 30] * 5 and sizes[5] == 3 << 20
    assert all(s % row == 0 for s in sizes)
    with pytest.raises(ValueError):
        image.shard_sizes(row - 1)


def test_weights_are_deterministic_npy(tmp_path):
    import numpy as np

    a = image.write_weights(tmp_path / "a", 3 * image.ROW * 2)
    b = image.write_weights(tmp_path / "b", 3 * image.ROW * 2)
    assert a[0].read_bytes() == b[0].read_bytes()
    arr = np.load(a[0])
    assert arr.dtype == np.float16 and arr.shape == (3, image.ROW)
    assert 0.01 < float(arr.astype(np.float32).std()) < 0.03


def test_with_latest_replaces_only_between_the_markers():
    readme = f"# T\n\n## Latest\n\n{run.README_BEGIN}\nold\n{run.README_END}\n\nafter\n"
    out = run.with_latest(readme, "| new |")
    assert "old" not in out and "| new |" in out and out.endswith("after\n")
    assert run.with_latest(out, "| newer |").count(run.README_BEGIN) == 1
    with pytest.raises(run.BenchError):
        run.with_latest("no markers", "x")


def test_other_images_are_kept_and_reported():
    small = _results()
    big = _results()
    big["image"] = {**big["image"], "tag": "tiny-6g", "compressed_bytes": 6_000_000_000}
    merged = run.merge_earlier(big, small)
    assert [e["image"]["tag"] for e in run.image_entries(merged)] == ["tiny-8m", "tiny-6g"]
    md = run.markdown_table(merged)
    # smallest image first, each preset heading names its image
    assert md.index("Image `tiny-8m`") < md.index("Image `tiny-6g`")
    assert "### tiny-8m, 1g-1ms: 1000 Mbit/s" in md and "### tiny-6g, 1g-1ms:" in md
    # measuring an image again replaces its earlier results; the rest stay
    again = run.merge_earlier(small, merged)
    assert [e["image"]["tag"] for e in again["other_images"]] == ["tiny-6g"]
    assert run.markdown_table(small).count("Image `") == 1


def test_presets_of_one_image_accumulate_across_runs():
    earlier = _results()
    earlier["generated"] = "2026-12-01T10:00:00+00:00"
    earlier["runs"] = 5
    earlier["presets"]["200m-20ms"] = {**earlier["presets"]["1g-1ms"],
                                       "preset": {"name": "200m-20ms", "rate_mbit": 200.0,
                                                  "rtt_ms": 20.0}}  # fmt: skip
    now = _results()
    now["generated"] = "2026-12-02T22:00:00+00:00"
    now["presets"]["1g-1ms"]["scenarios"]["full-pull"] = _scen(7.0, 9_000_000, 0)
    merged = run.merge_earlier(now, earlier)
    # this run's preset replaces the earlier one; the one it did not measure stays
    assert list(merged["presets"]) == ["1g-1ms", "200m-20ms"]
    assert merged["presets"]["1g-1ms"]["scenarios"]["full-pull"]["time_to_ready_s"]["median"] == 7
    kept = merged["presets"]["200m-20ms"]
    assert kept["generated"] == earlier["generated"] and kept["runs"] == 5
    md = run.markdown_table(merged)
    assert md.count("Measured by an earlier run: 2026-12-01T10:00:00+00:00, 5 runs") == 1
    # kept through a third run too, with its own stamp
    again = run.merge_earlier({**now, "presets": {}}, merged)
    assert again["presets"]["200m-20ms"]["generated"] == earlier["generated"]
    # another build of the image (new manifest digest) does not inherit the old figures
    rebuilt = {**now, "image": {**now["image"], "manifest_digest": "sha256:new"}}
    assert list(run.merge_earlier(rebuilt, merged)["presets"]) == ["1g-1ms"]


def test_partial_results_say_so():
    res = _results()
    res["runs"] = 3
    res["presets"]["1g-1ms"]["rounds"] = 1
    assert "**Partial: 1 of 3 rounds so far.**" in run.markdown_table(res)
    res["presets"]["1g-1ms"]["rounds"] = 3
    assert "Partial" not in run.markdown_table(res)


def test_paired_by_round():
    def scen(*secs: float) -> dict:
        runs = [{"seconds": x, "registry_bytes": 1, "wire_bytes": 1, "read_bytes": 1,
                 "phases_s": {}} for x in secs]  # fmt: skip
        return run.summarize_runs(runs, image_bytes=1000)

    scenarios = {"full-pull": scen(100.0, 60.0), "lazy-profile": scen(20.0, 30.0),
                 "local": scen(18.0, 25.0)}  # fmt: skip
    assert run.paired_by_round(scenarios, "full-pull", "lazy-profile", lambda a, b: a / b) == [
        5.0, 2.0,
    ]  # fmt: skip
    assert run.paired_by_round(scenarios, "lazy-profile", "local", lambda a, b: a - b) == [
        2.0, 5.0,
    ]  # fmt: skip
    # a failed run breaks the pairing of rounds: nothing is paired
    scenarios["local"]["failed_runs"] = ["boom"]
    assert run.paired_by_round(scenarios, "lazy-profile", "local", lambda a, b: a - b) == []
    notes = run.explain({**scenarios, "local": scen(18.0, 25.0)})
    assert any("full-pull / lazy-profile: 3.50x (5.00, 2.00)" in n for n in notes)


def test_targets_need_the_paired_rounds_too():
    def scen(*secs: float) -> dict:
        runs = [{"seconds": x, "registry_bytes": 1, "wire_bytes": 1, "read_bytes": 100,
                 "phases_s": {}} for x in secs]  # fmt: skip
        return run.summarize_runs(runs, image_bytes=1000)

    # Medians alone say 5x and +1 s, but round by round lazy-profile was never that close.
    scen_ = {"full-pull": scen(100.0, 50.0, 110.0), "lazy-profile": scen(20.0, 20.0, 40.0),
             "local": scen(19.0, 10.0, 30.0)}  # fmt: skip
    t = run.evaluate_targets(scen_)
    assert [x["met"] for x in t[:2]] == [False, False]
    assert "paired by round 2.8x (5.0x, 2.5x, 2.8x)" in t[0]["measured"]
    assert "paired by round +10.00s (+1.00s, +10.00s, +10.00s)" in t[1]["measured"]


def test_a_fetch_the_link_cannot_carry_in_time_is_named():
    scen = {
        "full-pull": _scen(90.0, 5_700_000_000),
        "lazy-profile": _scen(50.0, 5_000_000_000),
        "local": _scen(10.0, 0, 5_600_000_000),
    }
    notes = run.explain(scen, rate_mbit=1000.0)
    link = [n for n in notes if n.startswith("The link bounds the speedup")]
    assert link and "40.0 s at 1000 Mbit/s" in link[0] and "= 18.0 s" in link[0]
    assert "5,600.0 MB to start" in link[0]
    # a fetch the link carries in time: no such note
    scen["lazy-profile"] = _scen(12.0, 500_000_000)
    assert not any(n.startswith("The link") for n in run.explain(scen, rate_mbit=1000.0))
