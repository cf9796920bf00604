"""A startup profile: the files a container reads while it starts, in first-access order,
and for a file it reads only in part, which bytes of it.

``snapshotter profile`` writes one from a mount's log of the byte ranges read;
``imagetool convert --profile`` reads it, lays the profile's files out first and lists
the sectors that hold the bytes read as the image's prefetch order. The file is text::

    # lazyblock startup profile        comments and blank lines are ignored
    /usr/bin/python3.11                a file read whole
    /opt/venv/.../libtorch_cpu.so<TAB>0-1048576,8388608-8519680
                                       a file read in part: byte ranges [start, end)

A path alone means the whole file, so a plain list of paths (a hand-made profile, or one
from a version before ranges) is a profile too. Ranges matter for large files that a start
maps and reads in part: the shared libraries of ML images (an ML image's 434 MB
``libtorch_cpu.so``), where a profile of whole files listed 268 sectors and the start read
211 (678 against 633 MB stored). Ranges are offsets within the file, so a profile recorded
on one layout of an image applies to another (the profiled conversion moves files).

This module is the format: the writer and every reader use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from imagetool.errors import ProfileError
from imagetool.format import FileExtent

HEADER = "# lazyblock startup profile: files in first-access order; TAB then byte ranges read\n"
MAX_LINE = 1 << 20  # a path is at most PATH_MAX (4096); the rest is ranges
MAX_PATH = 4096
# Gaps between ranges shorter than this are read too (and so are heads and tails shorter
# than it): no sector is smaller (``format.MIN_SECTOR_SIZE``), so skipping less never saves
# a fetch, and the profile stays short.
MERGE_GAP = 64 << 10

Range = tuple[int, int]  # [start, end) within the file


@dataclass(frozen=True)
class ProfileEntry:
    path: str
    ranges: tuple[Range, ...] | None = None  # None: the whole file

    def spans(self, size: int) -> tuple[Range, ...]:
        """The ranges of this entry in a file of ``size`` bytes: clipped to it, the whole
        file for an entry without ranges."""
        if self.ranges is None:
            return ((0, size),) if size > 0 else ()
        return tuple((s, min(e, size)) for s, e in self.ranges if s < size)


@dataclass(frozen=True)
class Profile:
    entries: tuple[ProfileEntry, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(e.path for e in self.entries)

    @classmethod
    def of_paths(cls, paths: Iterable[str]) -> Profile:
        """A profile of whole files."""
        return cls(tuple(ProfileEntry(p) for p in paths))

    def render(self) -> str:
        """The profile as its file's text (paths with a line break or a tab cannot be
        written, and are left out)."""
        lines = [HEADER]
        for e in self.entries:
            if "\n" in e.path or "\t" in e.path or "\r" in e.path:
                continue
            if e.ranges is None:
                lines.append(f"{e.path}\n")
            else:
                lines.append(f"{e.path}\t{','.join(f'{s}-{t}' for s, t in e.ranges)}\n")
        return "".join(lines)


def merge(ranges: Iterable[Range], size: int, gap: int = MERGE_GAP) -> tuple[Range, ...] | None:
    """Ranges read of a ``size``-byte file, sorted and merged where less than ``gap`` apart
    (and stretched to the file's ends when less than ``gap`` from them); None when that
    covers the whole file."""
    out: list[list[int]] = []
    for s, e in sorted((max(0, s), min(e, size)) for s, e in ranges):
        if e <= s:
            continue
        if out and s - out[-1][1] < gap:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    if not out:
        return ()
    if out[0][0] < gap:
        out[0][0] = 0
    if size - out[-1][1] < gap:
        out[-1][1] = size
    if len(out) == 1 and out[0] == [0, size]:
        return None
    return tuple((s, e) for s, e in out)


def from_reads(
    reads: Iterable[Range], files_in_range: Callable[[int, int], Iterable[FileExtent]]
) -> Profile:
    """The profile of a mount's reads (image byte ranges ``(offset, length)`` in the order
    they were first read): the files they overlap, in first-access order, each with the
    ranges of it read (``merge``d: None when that is the whole file)."""
    sizes: dict[str, int] = {}
    got: dict[str, list[Range]] = {}
    for offset, length in reads:
        end = offset + length
        for f in files_in_range(offset, length):
            if f.path not in got:
                sizes[f.path], got[f.path] = f.length, []
            got[f.path].append(
                (max(offset, f.offset) - f.offset, min(end, f.offset + f.length) - f.offset)
            )
    return Profile(tuple(ProfileEntry(p, merge(r, sizes[p])) for p, r in got.items()))


def parse(text: str, name: str = "profile") -> Profile:
    """A profile from its text; ``ProfileError`` for text that is not one (a line that
    cannot be a path, ranges that are not ``start-end`` with start < end)."""
    entries: list[ProfileEntry] = []
    for n, line in enumerate(text.splitlines(), 1):
        path, tab, spec = line.partition("\t")
        path = path.strip()
        if not path or path.startswith("#"):
            continue
        if "\0" in path or len(path) > MAX_PATH or len(line) > MAX_LINE:
            raise ProfileError(f"{name}, line {n}: not a path: {line[:60]!r}")
        ranges = _parse_ranges(spec.strip(), f"{name}, line {n}") if tab else None
        entries.append(ProfileEntry("/" + path.lstrip("/"), ranges))
    return Profile(tuple(entries))


def _parse_ranges(spec: str, where: str) -> tuple[Range, ...]:
    out = []
    for part in spec.split(","):
        s, dash, e = part.partition("-")
        try:
            start, end = int(s), int(e)
        except ValueError:
            start = end = -1
        if not dash or start < 0 or end <= start:
            raise ProfileError(f"{where}: not a byte range (start-end): {part[:40]!r}")
        out.append((start, end))
    return tuple(out)


def read(path: Path) -> Profile:
    """A profile file; ``ProfileError`` for one that cannot be read or is not a profile:
    better refused at conversion than laid out wrong."""
    try:
        text = path.read_bytes().decode()
    except OSError as e:
        raise ProfileError(f"cannot read profile {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"profile {path} is not a UTF-8 text file (one path per line)") from None
    return parse(text, f"profile {path}")
