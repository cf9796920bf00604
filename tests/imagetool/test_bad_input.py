"""Bad input: a clear one-line error, a non-zero exit, and nothing half-written."""

from __future__ import annotations

import gzip
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from itool import imagetool
from ocibuild import (
    OCI_LAYER,
    OCI_LAYER_GZIP,
    TarEntry,
    blob_path,
    make_layer_tar,
    make_tar,
    manifest_of,
    write_oci_layout,
)

GOOD = [TarEntry("etc/hostname", data=b"x\n"), TarEntry("bin/app", data=b"\x7fELF" * 1000)]


def assert_clean_failure(res, store: Path, *needles: str) -> None:  # noqa: ANN001
    assert res.code != 0
    lines = res.err.strip().splitlines()
    assert len(lines) == 1, res.err  # one line, no traceback
    assert lines[0].startswith("imagetool: error:"), res.err
    for needle in needles:
        assert needle.lower() in lines[0].lower(), lines[0]
    # Nothing was published: no tag, no index blob.
    assert not (store / "refs").exists() or not any((store / "refs").rglob("*")), "tag written"
    blobs = list((store / "blobs").rglob("*")) if (store / "blobs").exists() else []
    assert not [b for b in blobs if b.is_file()], "blob left behind"


def convert(layout: Path, store: Path, *extra: str):  # noqa: ANN201
    return imagetool("convert", "-q", *extra, f"oci:{layout}:latest", f"{store}/img:t",
                     check=False)  # fmt: skip


def test_corrupt_gzip(tmp_path):
    layer = bytearray(make_layer_tar(GOOD + [TarEntry("big", data=bytes(range(256)) * 4000)]))
    layer[len(layer) // 2 : len(layer) // 2 + 64] = b"\xff" * 64
    config = {"architecture": "amd64", "os": "linux",
              "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "0" * 64]}}  # fmt: skip
    write_oci_layout(tmp_path / "oci", [bytes(layer)], config=config)
    assert_clean_failure(convert(tmp_path / "oci", tmp_path / "store"), tmp_path / "store")


def test_truncated_gzip_layer_with_matching_digest(tmp_path):
    full = make_layer_tar(GOOD + [TarEntry("big", data=bytes(range(256)) * 4000)])
    config = {"architecture": "amd64", "os": "linux",
              "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "0" * 64]}}  # fmt: skip
    # The blob digest matches the truncated bytes: only decompression can notice.
    write_oci_layout(tmp_path / "oci", [full[: len(full) // 2]], config=config)
    assert_clean_failure(convert(tmp_path / "oci", tmp_path / "store"), tmp_path / "store")


def test_truncated_tar(tmp_path):
    tar = make_tar(GOOD + [TarEntry("big", data=b"y" * 100_000)])
    write_oci_layout(tmp_path / "oci", [gzip.compress(tar[:50_000], mtime=0)])
    res = convert(tmp_path / "oci", tmp_path / "store")
    assert_clean_failure(res, tmp_path / "store")


def test_blob_digest_mismatch(tmp_path):
    layer = make_layer_tar(GOOD)
    digest = write_oci_layout(tmp_path / "oci", [layer])
    layer_digest = manifest_of(tmp_path / "oci", digest)["layers"][0]["digest"]
    path = blob_path(tmp_path / "oci", layer_digest)
    path.write_bytes(make_layer_tar([TarEntry("etc/hostname", data=b"tampered\n")]))
    assert_clean_failure(convert(tmp_path / "oci", tmp_path / "store"), tmp_path / "store",
                         "digest")  # fmt: skip


@pytest.mark.parametrize(
    "entry",
    [TarEntry("../escape", data=b"x"), TarEntry("/abs", data=b"x")],
    ids=["dotdot", "absolute"],
)
def test_entries_escaping_root(tmp_path, entry):
    write_oci_layout(tmp_path / "oci", [make_layer_tar([*GOOD, entry])])
    assert_clean_failure(convert(tmp_path / "oci", tmp_path / "store"), tmp_path / "store")


def test_write_through_symlink_across_layers(tmp_path):
    l1 = make_layer_tar([TarEntry("etc", "symlink", link="/tmp")])
    l2 = make_layer_tar([TarEntry("etc/passwd", data=b"root::0:0::/:/bin/sh\n")])
    write_oci_layout(tmp_path / "oci", [l1, l2])
    assert_clean_failure(convert(tmp_path / "oci", tmp_path / "store"), tmp_path / "store",
                         "symlink")  # fmt: skip


def test_unknown_media_type(tmp_path):
    write_oci_layout(tmp_path / "oci", [make_layer_tar(GOOD)],
                     media_types=["application/x-mystery"])  # fmt: skip
    assert_clean_failure(convert(tmp_path / "oci", tmp_path / "store"), tmp_path / "store",
                         "media type")  # fmt: skip


def test_missing_blob(tmp_path):
    digest = write_oci_layout(tmp_path / "oci", [make_layer_tar(GOOD)])
    layer_digest = manifest_of(tmp_path / "oci", digest)["layers"][0]["digest"]
    blob_path(tmp_path / "oci", layer_digest).unlink()
    assert_clean_failure(convert(tmp_path / "oci", tmp_path / "store"), tmp_path / "store")


def test_missing_layout_and_bad_specs(tmp_path):
    store = tmp_path / "store"
    for source in [f"oci:{tmp_path}/nope:latest", "tarball:/x", f"oci:{tmp_path}"]:
        res = imagetool("convert", "-q", source, f"{store}/img:t", check=False)
        assert_clean_failure(res, store)
    write_oci_layout(tmp_path / "oci", [make_layer_tar(GOOD)])
    res = imagetool("convert", "-q", f"oci:{tmp_path}/oci:latest", f"{store}/Bad Name:t",
                    check=False)  # fmt: skip
    assert_clean_failure(res, store)
    res = imagetool("convert", "-q", "--sector-size", "3000", f"oci:{tmp_path}/oci:latest",
                    f"{store}/img:t", check=False)  # fmt: skip
    assert res.code != 0 and "Traceback" not in res.err


def test_registry_that_refuses_connections(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = imagetool("--plain-http", "--timeout", "2", "convert", "-q",
                    f"docker://127.0.0.1:{port}/app:v1", f"{tmp_path}/store/img:t",
                    check=False)  # fmt: skip
    assert_clean_failure(res, tmp_path / "store")


def test_registry_that_never_answers(tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted = []
    stop = threading.Event()

    def hold() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])  # accept and never answer
            except OSError:
                pass

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    try:
        port = listener.getsockname()[1]
        res = imagetool("--plain-http", "--timeout", "1", "convert", "-q",
                        f"docker://127.0.0.1:{port}/app:v1", f"{tmp_path}/store/img:t",
                        check=False)  # fmt: skip
        assert_clean_failure(res, tmp_path / "store")
    finally:
        stop.set()
        t.join()
        for c in accepted:
            c.close()
        listener.close()


def test_registry_404_for_unknown_image(tmp_path, registry):
    res = imagetool("--plain-http", "convert", "-q", f"docker://{registry.host}/no/such:tag",
                    f"{tmp_path}/store/img:t", check=False)  # fmt: skip
    assert_clean_failure(res, tmp_path / "store")


def test_good_input_after_all(tmp_path):
    write_oci_layout(tmp_path / "oci", [make_layer_tar(GOOD)],
                     media_types=[OCI_LAYER_GZIP])  # fmt: skip
    res = convert(tmp_path / "oci", tmp_path / "store")
    assert res.code == 0, res.err
    assert json.loads(imagetool("inspect", f"{tmp_path}/store/img:t").out)["files"] == 2


def _has_staged_bytes(stage: Path) -> bool:
    """Whether a staging file under ``stage`` holds bytes yet; the conversion renames and
    removes its files while this looks, so a walk that meets one vanishing looks again
    on the next poll."""
    try:
        return any(p.is_file() and p.stat().st_size for p in stage.rglob("*"))
    except FileNotFoundError:  # a file or directory went while being looked at
        return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stopped_conversion_leaves_nothing(tmp_path, signum):
    """A conversion stopped mid-way (a job killed, Ctrl-C) removes its staging files and
    publishes nothing."""
    # 24 files of 8 MiB of random bytes (plain tar: cheap to build, slow enough to convert)
    rng = random.Random(7)
    entries = [TarEntry(f"data/f{i:02d}", data=rng.randbytes(8 << 20)) for i in range(24)]
    write_oci_layout(tmp_path / "oci", [make_layer_tar(entries, compression=None)],
                     media_types=[OCI_LAYER])  # fmt: skip
    stage, store = tmp_path / "stage", tmp_path / "store"
    stage.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "imagetool.cli", "convert", "-q", "--tmpdir", str(stage),
         f"oci:{tmp_path / 'oci'}:latest", f"{store}/img:t"],
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _has_staged_bytes(stage):
            assert proc.poll() is None, "conversion ended before it could be stopped"
            assert time.monotonic() < deadline, "no staging file appeared"
            time.sleep(0.01)
        proc.send_signal(signum)
        err = proc.communicate(timeout=60)[1].decode()
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip() == "imagetool: interrupted", err
    assert not list(stage.iterdir()), "staging files left behind"
    refs = list((store / "refs").rglob("*")) if (store / "refs").exists() else []
    assert not [r for r in refs if r.is_file()], "tag written"
