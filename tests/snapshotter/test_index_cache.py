"""The node's index cache (``snapshotter.cache.indexes``): only verified bytes come out."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from snapshotter.cache import indexes as indexcache


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_saved_index_loads_only_while_it_matches_its_digest(tmp_path: Path) -> None:
    data = b'{"an": "index"}'
    digest = _digest(data)
    assert indexcache.load(tmp_path, digest) is None
    indexcache.save(tmp_path, digest, data)
    assert indexcache.load(tmp_path, digest) == data
    path = tmp_path / "indexes" / digest.replace(":", "-")
    path.write_bytes(b"something else")
    assert indexcache.load(tmp_path, digest) is None
    assert not path.exists()  # a bad copy is removed


def test_what_is_not_a_sha256_digest_is_never_a_file(tmp_path: Path) -> None:
    for name in ("not-a-digest", "sha256:../../etc", "md5:" + "0" * 32):
        indexcache.save(tmp_path, name, b"x")
        assert indexcache.load(tmp_path, name) is None
    assert not (tmp_path / "indexes").exists() or not list((tmp_path / "indexes").iterdir())


def test_least_recently_used_indexes_go_beyond_the_cap(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(indexcache, "MAX_ENTRIES", 3)
    blobs = [f"index {i}".encode() for i in range(5)]
    for i, data in enumerate(blobs[:3]):
        indexcache.save(tmp_path, _digest(data), data)
        path = tmp_path / "indexes" / _digest(data).replace(":", "-")
        os.utime(path, ns=(i * 10**9, i * 10**9))
    assert indexcache.load(tmp_path, _digest(blobs[0])) == blobs[0]  # now the most recent
    for data in blobs[3:]:
        indexcache.save(tmp_path, _digest(data), data)
    kept = {data for data in blobs if indexcache.load(tmp_path, _digest(data)) is not None}
    assert kept == {blobs[0], blobs[3], blobs[4]}
