"""Layer flattening: whiteouts, opaque directories, hard links, unsafe paths."""

from __future__ import annotations

import io
import stat

import pytest
from ocibuild import TarEntry, make_tar, opaque, whiteout

from imagetool.errors import InvalidSourceError, UnsafePathError
from imagetool.tree import HashSink, Tree, apply_layer


def flatten(*layers: list[TarEntry]) -> Tree:
    tree = Tree()
    for n, entries in enumerate(layers):
        apply_layer(tree, io.BytesIO(make_tar(entries)), HashSink(), f"layer{n}")
    return tree


def paths(tree: Tree) -> list[str]:
    return [p for p, _ in tree.walk()]


def test_later_layers_replace_and_merge():
    tree = flatten(
        [TarEntry("etc", "dir", mode=0o700), TarEntry("etc/a", data=b"1"),
         TarEntry("x", data=b"x")],
        [TarEntry("etc", "dir", mode=0o755, uid=5), TarEntry("etc/b", data=b"2"),
         TarEntry("x", "symlink", link="etc/a")],
    )  # fmt: skip
    assert paths(tree) == ["/", "/etc", "/etc/a", "/etc/b", "/x"]
    etc = tree.lookup("/etc")
    assert stat.S_IMODE(etc.mode) == 0o755 and etc.uid == 5
    assert tree.lookup("/x").is_symlink


def test_whiteout_removes_lower_entry_and_subtree():
    tree = flatten(
        [TarEntry("a/b/c", data=b"c"), TarEntry("a/keep", data=b"k")],
        [whiteout("a/b")],
    )
    assert paths(tree) == ["/", "/a", "/a/keep"]


def test_opaque_hides_lower_but_keeps_same_layer_entries():
    # The marker may come before or after the layer's own entries in that directory.
    tree = flatten(
        [TarEntry("d/old1", data=b"1"), TarEntry("d/old2", data=b"2")],
        [TarEntry("d/new", data=b"n"), opaque("d"), TarEntry("d/newer", data=b"m")],
    )
    assert paths(tree) == ["/", "/d", "/d/new", "/d/newer"]


def test_file_replaced_by_directory_and_back():
    tree = flatten(
        [TarEntry("p", data=b"file")],
        [TarEntry("p/child", data=b"c")],
        [TarEntry("p", data=b"file again")],
    )
    assert paths(tree) == ["/", "/p"]
    assert tree.lookup("/p").size == len(b"file again")


def test_hard_links_share_a_node_until_replaced():
    tree = flatten(
        [TarEntry("f", data=b"data"), TarEntry("g", "hardlink", link="f")],
        [TarEntry("g", data=b"new")],
    )
    f, g = tree.lookup("/f"), tree.lookup("/g")
    assert f is not g and f.size == 4 and g.size == 3
    tree = flatten([TarEntry("f", data=b"data"), TarEntry("./g", "hardlink", link="./f")])
    assert tree.lookup("/f") is tree.lookup("/g")


def test_metadata_and_xattrs():
    cap = b"\x01\x00\x00\x02\x00\x20\x00\x00" + bytes(12)
    tree = flatten(
        [TarEntry("bin/ping", data=b"x", mode=0o4755, uid=70000, gid=70001,
                  xattrs={"security.capability": cap, "user.k": "v"}),
         TarEntry("dev/null", "char", devmajor=1, devminor=3),
         TarEntry("tmp", "dir", mode=0o1777), TarEntry("p", "fifo")]
    )  # fmt: skip
    ping = tree.lookup("/bin/ping")
    assert stat.S_IMODE(ping.mode) == 0o4755 and (ping.uid, ping.gid) == (70000, 70001)
    assert ping.xattrs == {"security.capability": cap, "user.k": b"v"}
    assert tree.lookup("/dev/null").rdev == __import__("os").makedev(1, 3)
    assert stat.S_IMODE(tree.lookup("/tmp").mode) == 0o1777
    assert stat.S_ISFIFO(tree.lookup("/p").mode)


@pytest.mark.parametrize(
    "entries",
    [
        [TarEntry("../evil", data=b"x")],
        [TarEntry("a/../../evil", data=b"x")],
        [TarEntry("/etc/passwd", data=b"x")],
        [TarEntry("link", "symlink", link="/etc"), TarEntry("link/passwd", data=b"x")],
        [TarEntry("link", "symlink", link="/etc"), TarEntry("h", "hardlink", link="link/passwd")],
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "through-symlink", "hardlink-through-symlink"],
)
def test_entries_escaping_the_root_are_refused(entries):
    with pytest.raises(UnsafePathError):
        flatten(entries)


def test_hard_link_to_missing_file_is_an_error():
    with pytest.raises(InvalidSourceError, match="missing"):
        flatten([TarEntry("g", "hardlink", link="nope")])


def test_truncated_tar_is_an_error():
    data = make_tar([TarEntry("big", data=b"x" * 100000)])
    with pytest.raises(InvalidSourceError):
        apply_layer(Tree(), io.BytesIO(data[:20000]), HashSink(), "layer0")


def test_tar_cut_at_a_header_boundary_is_an_error():
    # tarfile itself ends quietly when a header is missing; a layer must end with a zero block.
    data = make_tar([TarEntry("a", data=b"x" * 512), TarEntry("b", data=b"y")])
    with pytest.raises(InvalidSourceError, match="truncated"):
        apply_layer(Tree(), io.BytesIO(data[:1024]), HashSink(), "layer0")


def test_many_entries_through_read_ahead():
    """Headers straddling the read-ahead's chunk boundaries must not end the layer early."""
    from imagetool.readahead import ReadAhead

    class Trickle(io.BytesIO):
        def read(self, n=-1):  # noqa: ANN001, ANN202 - odd-sized reads, like a decompressor
            return super().read(min(n, 1000) if n and n > 0 else 1000)

    entries = [TarEntry(f"d/f{i:05d}", data=b"z" * (i % 700)) for i in range(5000)]
    tree = Tree()
    with ReadAhead(Trickle(make_tar(entries))) as ahead:
        apply_layer(tree, ahead, HashSink(), "layer0")  # type: ignore[arg-type]
    assert len(tree.lookup("/d").children) == 5000
