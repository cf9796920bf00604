"""The startup profile's text format: paths in first-access order, each with the byte
ranges read of it when the start read only part of the file."""

from __future__ import annotations

import pytest

from imagetool import profile as profiles
from imagetool.errors import ProfileError
from imagetool.format import FileExtent
from imagetool.profile import MERGE_GAP, Profile, ProfileEntry

KIB = 1 << 10


def test_a_list_of_paths_is_a_profile_of_whole_files() -> None:
    text = "# a comment\n\n/etc/hosts\nusr/bin/python3\n  /app/main.py  \n"
    assert profiles.parse(text) == Profile.of_paths(["/etc/hosts", "/usr/bin/python3",
                                                     "/app/main.py"])  # fmt: skip


def test_ranges_survive_a_round_trip_through_the_text() -> None:
    profile = Profile((
        ProfileEntry("/usr/bin/python3"),
        ProfileEntry("/lib/libtorch.so", ((0, 4096), (1 << 20, 3 << 20))),
        ProfileEntry("/etc/hosts"),
    ))  # fmt: skip
    text = profile.render()
    assert text.startswith("#")
    assert "/lib/libtorch.so\t0-4096,1048576-3145728\n" in text
    assert profiles.parse(text) == profile


def test_paths_that_cannot_be_written_on_a_line_are_left_out() -> None:
    profile = Profile.of_paths(["/a", "/b\nc", "/d\te", "/f"])
    assert profiles.parse(profile.render()).paths == ("/a", "/f")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("/lib/a.so\t10-5", "line 2: not a byte range"),
        ("/lib/a.so\tx-5", "line 2: not a byte range"),
        ("/lib/a.so\t7", "line 2: not a byte range"),
        ("/lib/a.so\t0-4096,", "line 2: not a byte range"),
        ("/lib/\0a.so", "line 2: not a path"),
    ],
)
def test_a_line_that_is_not_a_path_and_ranges_is_refused(line: str, message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        profiles.parse(f"/etc/hosts\n{line}\n", "p")


def test_merge_joins_ranges_closer_than_a_sector_and_says_when_that_is_the_whole_file() -> None:
    size = 10 << 20
    # out of order, overlapping, and a gap just under MERGE_GAP: one range
    got = profiles.merge([(1 << 20, 2 << 20), (200 * KIB, 1 << 20), (2 << 20, 3 << 20)], size)
    assert got == ((200 * KIB, 3 << 20),)
    gap = (3 << 20) + MERGE_GAP - 1
    assert profiles.merge([(200 * KIB, 3 << 20), (gap, 4 << 20)], size) == ((200 * KIB, 4 << 20),)
    assert profiles.merge([(200 * KIB, 3 << 20), (gap + 1, 4 << 20)], size) == (
        (200 * KIB, 3 << 20), (gap + 1, 4 << 20),
    )  # fmt: skip
    # a head or tail shorter than the gap is read too
    assert profiles.merge([(4 * KIB, 1 << 20)], size) == ((0, 1 << 20),)
    assert profiles.merge([(1 << 20, size - 4 * KIB)], size) == ((1 << 20, size),)
    # which can make it the whole file: no ranges
    assert profiles.merge([(4 * KIB, size - 4 * KIB)], size) is None
    assert profiles.merge([(0, 100)], 300) is None  # a small file read at all is read whole


def test_reads_become_files_in_first_access_order_with_the_ranges_of_each() -> None:
    files = [
        FileExtent("/usr/bin/python3", 0, 300 * KIB),
        FileExtent("/app/main.py", 300 * KIB, 2 * KIB),
        FileExtent("/lib/libtorch.so", 512 * KIB, 8 << 20),
    ]

    def files_in_range(offset: int, length: int) -> list[FileExtent]:
        return [f for f in files if f.offset < offset + length and offset < f.offset + f.length]

    lib = 512 * KIB
    reads = [
        (lib + (4 << 20), 128 * KIB),  # the library's middle first
        (0, 300 * KIB + KIB),  # all of python3 and the start of main.py
        (lib, 64 * KIB),  # the library's head
        (lib + (4 << 20) + 128 * KIB, 128 * KIB),  # next to its first read
    ]
    got = profiles.from_reads(reads, files_in_range)
    assert got.paths == ("/lib/libtorch.so", "/usr/bin/python3", "/app/main.py")
    assert got.entries[0].ranges == ((0, 64 * KIB), (4 << 20, (4 << 20) + 256 * KIB))
    assert got.entries[1].ranges is None and got.entries[2].ranges is None


def test_spans_clip_ranges_to_the_file_they_are_applied_to() -> None:
    entry = ProfileEntry("/lib/a.so", ((0, 4096), (8192, 20_000), (30_000, 40_000)))
    assert entry.spans(10_000) == ((0, 4096), (8192, 10_000))
    assert ProfileEntry("/lib/a.so").spans(10_000) == ((0, 10_000),)
    assert ProfileEntry("/lib/a.so").spans(0) == ()
