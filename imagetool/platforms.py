"""Platforms (``os/arch[/variant]``) and picking one out of an image index, as containerd does.

One owner for what every reader of an index needs: ``imagetool.sources`` picks the source
image to convert, ``imagetool.stores`` resolves a reference to a multi-platform block image
to the node's platform, and ``snapshotter pull`` picks the image it has containerd pull.

``Platform.parse`` reads ``os/arch[/variant]`` (architecture aliases such as ``x86_64`` and
``aarch64`` normalised), ``default_platform`` is the running machine's, ``Platform.matches``
is containerd's rule (a wanted platform without a variant takes any variant; ``arm64`` is
``arm64/v8``), and ``select_platform`` picks an index entry, with an exact variant match
winning over a looser one, or raises ``NotFoundError`` naming the platforms there are.
``parse_platform_list`` reads ``convert --platform``'s ``all`` or comma list.
"""

from __future__ import annotations

import platform as _platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from imagetool.errors import InvalidReferenceError, NotFoundError

T = TypeVar("T")

# ``convert --platform all``: every platform of the source's index.
ALL_PLATFORMS = "all"

_ARCH_ALIASES = {"x86_64": "amd64", "x86-64": "amd64", "aarch64": "arm64", "i386": "386"}
_MACHINE_PLATFORMS = {
    "x86_64": ("amd64", None),
    "amd64": ("amd64", None),
    "aarch64": ("arm64", None),
    "arm64": ("arm64", None),
    "armv7l": ("arm", "v7"),
    "armv6l": ("arm", "v6"),
    "i686": ("386", None),
    "i386": ("386", None),
    "ppc64le": ("ppc64le", None),
    "s390x": ("s390x", None),
    "riscv64": ("riscv64", None),
}


@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str | None = None

    def __str__(self) -> str:
        parts = [self.os, self.architecture] + ([self.variant] if self.variant else [])
        return "/".join(parts)

    @classmethod
    def parse(cls, text: str) -> Platform:
        """``os/arch[/variant]``; architecture aliases (x86_64, aarch64) are normalised."""
        parts = text.strip().lower().split("/")
        if len(parts) not in (2, 3) or not all(parts):
            raise InvalidReferenceError(f"invalid platform {text!r}: expected os/arch[/variant]")
        return cls.of(parts[0], parts[1], parts[2] if len(parts) == 3 else None)

    @classmethod
    def of(cls, os: Any, arch: Any, variant: Any = None) -> Platform:
        arch = str(arch or "").lower()
        arch = _ARCH_ALIASES.get(arch, arch)
        return cls(str(os or "").lower(), arch, str(variant).lower() if variant else None)

    @classmethod
    def from_json(cls, doc: Any) -> Platform | None:
        """An OCI descriptor's or config's ``os``/``architecture``/``variant``; None if it
        names neither."""
        if not isinstance(doc, dict) or not (doc.get("os") or doc.get("architecture")):
            return None
        return cls.of(doc.get("os"), doc.get("architecture"), doc.get("variant"))

    def to_json(self) -> dict[str, str]:
        """The OCI descriptor's ``platform`` object."""
        doc = {"architecture": self.architecture, "os": self.os}
        if self.variant:
            doc["variant"] = self.variant
        return doc

    def matches(self, other: Platform) -> bool:
        """Whether ``other`` (an image's platform) satisfies this (a wanted platform). A
        wanted platform without a variant accepts any variant; arm64 means arm64/v8."""
        if (self.os, self.architecture) != (other.os, other.architecture):
            return False
        if self.variant is None:
            return True
        if self.architecture == "arm64":
            return (self.variant or "v8") == (other.variant or "v8")
        return self.variant == other.variant


def default_platform() -> str:
    """The platform of the running machine, as other tools pick it (``linux/amd64`` on x86)."""
    machine = _platform.machine().lower()
    arch, variant = _MACHINE_PLATFORMS.get(machine, (machine, None))
    return str(Platform("linux", arch, variant))


def select_platform(
    entries: Sequence[T], platform_of: Callable[[T], Platform | None], want: Platform, what: str
) -> T:
    """The entry of an index for ``want`` (the first, where several match; an exact variant
    match wins over a looser one). ``NotFoundError`` listing the index's platforms if none."""
    candidates = [(e, p) for e in entries if (p := platform_of(e)) and want.matches(p)]
    if candidates:
        exact = [e for e, p in candidates if p.variant == want.variant]
        return (exact or [e for e, _ in candidates])[0]
    raise NotFoundError(
        f"{what}: no image for platform {want}; available: "
        f"{', '.join(available_platforms(entries, platform_of)) or 'none'}"
    )


def available_platforms(
    entries: Sequence[T], platform_of: Callable[[T], Platform | None]
) -> list[str]:
    """The platforms an index names, sorted, each once."""
    return sorted({str(p) for e in entries if (p := platform_of(e))})


def parse_platform_list(text: str) -> tuple[Platform, ...] | None:
    """``convert --platform``: ``all`` (None: every platform of the source) or a comma list
    of ``os/arch[/variant]`` (at least one, none twice)."""
    if text.strip().lower() == ALL_PLATFORMS:
        return None
    items = [t for t in (s.strip() for s in text.split(",")) if t]
    if not items:
        raise InvalidReferenceError(f"invalid platform list {text!r}: expected os/arch[,...]")
    platforms = tuple(Platform.parse(t) for t in items)
    if len(set(platforms)) != len(platforms):
        raise InvalidReferenceError(f"platform list {text!r} names a platform twice")
    return platforms


def is_platform_list(text: str | None) -> bool:
    """Whether ``convert --platform`` asks for a multi-platform conversion (``all`` or a
    comma list) rather than one image."""
    return text is not None and (text.strip().lower() == ALL_PLATFORMS or "," in text)
