"""benchmarks/cpustages.py: perf's samples read and put in the stages of the data path."""

from __future__ import annotations

import subprocess
import sys

from support import require, require_tool

from benchmarks.cpustages import CpuStages, parse_script, tabulate

SCRIPT = """\
python  4242/4250
\tffffffff82243868 __pi_memcpy+0x8 ([kernel.kallsyms])
\tffffffff8186107f fuse_copy_do+0x5f ([kernel.kallsyms])
\tffffffff8186684b fuse_dev_write+0x8b ([kernel.kallsyms])
\t           fde9d __GI___writev+0x4d (/usr/lib/x86_64-linux-gnu/libc.so.6)

python  4242/4251
\t    7f0000001000 ZSTD_decompressSequences_bmi2.constprop.0 (/x/backend_c.so)
\t    7f0000002000 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)

python  4242/4251
\t    7f0000003000 XXHL128_seed_avx2 (/x/_xxhash.so)

python  4242/4251
\t    7f0000004000 [unknown] (/usr/lib/x86_64-linux-gnu/libzstd.so.1.5.4)
\t    7f0000005000 decode_into (/x/imagetool/_sectorcodec.cpython-311-x86_64-linux-gnu.so)

python  4242/4251
\t    7f0000006000 XXH3_64bits_dispatch (/usr/lib/x86_64-linux-gnu/libxxhash.so.0.8.1)
\t    7f0000005000 decode_into (/x/imagetool/_sectorcodec.cpython-311-x86_64-linux-gnu.so)

python  4242/4252
\tffffffff82243868 __pi_memcpy+0x8 ([kernel.kallsyms])
\tffffffff81111111 _copy_to_iter+0x10 ([kernel.kallsyms])
\tffffffff81222222 tcp_recvmsg+0x30 ([kernel.kallsyms])

python  4242/4253
\tffffffff81444444 recently_deleted+0x2a ([kernel.kallsyms])
\tffffffff81444555 find_inode_bit+0x90 ([kernel.kallsyms])
\tffffffff81444666 __ext4_new_inode+0x5d0 ([kernel.kallsyms])
\tffffffff81444777 path_openat+0x100 ([kernel.kallsyms])

reader  77/77
\tffffffff81333333 filemap_read+0x1 ([kernel.kallsyms])

swapper  0/0
\tffffffff8224215b pv_native_safe_halt ([kernel.kallsyms])

docker-registry  99/101
\t    55550000 runtime.memmove (/usr/bin/docker-registry)
"""


def test_samples_go_to_the_stage_of_their_outermost_rule() -> None:
    samples = parse_script(SCRIPT)
    assert [(c, p) for c, p, _ in samples][:2] == [("python", 4242), ("python", 4242)]
    report = tabulate(samples, {"server": 4242, "reader": 77}, 1.0, frequency=1)
    per = report["per_GB"]
    # the memcpy under fuse_dev_write is the FUSE reply; under tcp_recvmsg, the receive
    # libzstd without symbols is decompression by its library; a hash under the compiled
    # codec is a hash; a new inode for a cache entry is the cache's files
    assert per["server"] == {"fuse_reply": 1, "decompress": 2, "hash": 2, "receive": 1,
                             "cache_files": 1, "total": 7}  # fmt: skip
    assert per["reader"] == {"cache_read": 1, "total": 1}
    assert per["idle"] == {"wakeup": 1, "total": 1}
    assert per["other:docker-registry"]["total"] == 1
    assert report["seconds"] == 10


def test_a_real_recording_sees_a_busy_process() -> None:
    require_tool("perf")
    spin = "import time\nt = time.time()\nwhile time.time() - t < 1: pass"
    with CpuStages(frequency=199) as stages:
        require(stages.available, "perf cannot record here (perf_event_paranoid?)")
        busy = subprocess.Popen([sys.executable, "-c", spin])
        busy.wait()
    try:
        per = stages.report({"busy": busy.pid}, 1.0)["per_GB"]
    finally:
        stages.close()
    assert per["busy"]["total"] > 0.5  # about 1 CPU-second, sampled


def test_a_recording_of_one_process_sees_it_alone() -> None:
    require_tool("perf")
    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    other = subprocess.Popen([sys.executable, "-c", spin])
    try:
        with CpuStages(frequency=199, pid=busy.pid) as stages:
            require(stages.available, "perf cannot record here (perf_event_paranoid?)")
            busy.wait()
        per = stages.report({"busy": busy.pid, "other": other.pid}, 1.0)["per_GB"]
    finally:
        other.wait()
        stages.close()
    assert per["busy"]["total"] > 0.3 and "other" not in per, per
