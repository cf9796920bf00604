"""Image references: which store, which image name, which tag or digest.

    /path/to/store/NAME[:TAG|@sha256:HEX]        a directory store (also relative paths)
    file:///path/to/store/NAME[:TAG|@sha256:HEX]
    s3://BUCKET[/PREFIX]/NAME[:TAG|@sha256:HEX]
    docker://HOST[:PORT]/REPO/PATH[:TAG|@sha256:HEX]

For directory and S3 stores the last path component is ``NAME[:TAG]`` and everything before
it is the store. For ``docker://`` the whole repository path is the name. ``@sha256:`` names
an index digest directly (for ``docker://``, a manifest digest). The tag defaults to
``latest`` unless a digest is given. This module only parses; ``imagetool.stores.open_store``
turns a reference into a ``Store``.

It also owns the names registries go by elsewhere: ``split_image_ref`` reads an image name
the way containerd and the kubelet write it (``ubuntu:22.04``, ``host:5000/team/app@...``,
Docker Hub's defaults applied), and ``registry_host`` is the one normaliser of a registry's
host, whether it comes from such a name, a docker ``config.json`` key
(``https://index.docker.io/v1/``) or a CRI ``AuthConfig.server_address``: credentials are
looked up and matched by what it returns.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from imagetool.errors import InvalidReferenceError

DEFAULT_TAG = "latest"

# The distribution spec's grammar, shared by every backend so that one name works everywhere.
_NAME_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HOST = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?"
)
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")

# Docker Hub's names: what an image name without a host means, and the host it is served from.
DOCKER_HUB = "docker.io"
DOCKER_HUB_REGISTRY = "registry-1.docker.io"
_DOCKER_HUB_HOSTS = frozenset({DOCKER_HUB, DOCKER_HUB_REGISTRY, "index.docker.io"})

SCHEME_DIR = "dir"
SCHEME_S3 = "s3"
SCHEME_DOCKER = "docker"


@dataclass(frozen=True)
class ImageRef:
    """A parsed reference. ``tag`` is ``None`` only when a digest is given without one."""

    store_url: str  # "/srv/images", "s3://bucket/prefix", "docker://host:5000"
    name: str  # "myimage" or, for docker://, the repository path "team/myimage"
    tag: str | None = DEFAULT_TAG
    digest: str | None = None

    @property
    def scheme(self) -> str:
        if self.store_url.startswith("s3://"):
            return SCHEME_S3
        if self.store_url.startswith("docker://"):
            return SCHEME_DOCKER
        return SCHEME_DIR

    def __str__(self) -> str:
        text = f"{self.store_url.rstrip('/')}/{self.name}"
        if self.tag is not None:
            text += f":{self.tag}"
        if self.digest is not None:
            text += f"@{self.digest}"
        return text


def check_name_component(name: str, text: str = "") -> str:
    if not _NAME_COMPONENT.fullmatch(name):
        raise InvalidReferenceError(
            f"invalid image name {name!r}{_in(text)}: use lowercase letters, digits and "
            "single '.', '_' or '-' separators"
        )
    return name


def check_tag(tag: str, text: str = "") -> str:
    if not _TAG.fullmatch(tag):
        raise InvalidReferenceError(
            f"invalid tag {tag!r}{_in(text)}: up to 128 letters, digits, '_', '.' or '-', "
            "not starting with '.' or '-'"
        )
    return tag


def parse_ref(text: str) -> ImageRef:
    """Parse an image reference; ``InvalidReferenceError`` with a one-line message if malformed."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidReferenceError("empty image reference")
    if any(c.isspace() for c in text):
        raise InvalidReferenceError(f"image reference {text!r} contains whitespace")
    scheme, sep, rest = text.partition("://")
    if not sep:
        return _parse_dir(text, text)
    if scheme == "file":
        host, slash, path = rest.partition("/")
        if host not in ("", "localhost") or not slash:
            raise InvalidReferenceError(
                f"file reference {text!r} must be file:///absolute/path/NAME[:TAG]"
            )
        return _parse_dir("/" + path, text)
    if scheme == "s3":
        return _parse_s3(rest, text)
    if scheme == "docker":
        return _parse_docker(rest, text)
    raise InvalidReferenceError(
        f"unknown store scheme {scheme!r} in {text!r} (use a path, file://, s3:// or docker://)"
    )


def absolute_ref(text: str) -> str:
    """``text`` with a relative directory store made absolute (against the current
    directory), for a reference handed to a process that may run elsewhere (a mount's
    server); any other reference is returned as it is. ``InvalidReferenceError`` if malformed."""
    ref = parse_ref(text)
    if ref.scheme != SCHEME_DIR or os.path.isabs(ref.store_url):
        return text
    return str(replace(ref, store_url=os.path.abspath(ref.store_url)))


def registry_host(text: str) -> str:
    """The registry ``host[:port]`` that ``text`` names: a bare host, or a URL such as a
    docker ``config.json`` key (``https://host:5000/v1/``). Docker Hub's several names
    come out as one, ``registry-1.docker.io``."""
    if "://" in text:
        text = text.split("://", 1)[1]
    host = text.split("/", 1)[0]
    return DOCKER_HUB_REGISTRY if host in _DOCKER_HUB_HOSTS else host


def split_image_ref(ref: str) -> tuple[str, str]:
    """An image name as containerd and the kubelet write it (``host[:port]/repo[:tag]
    [@digest]``, normalised or not) -> (registry host, repository), with Docker Hub's
    defaults: no host means ``registry-1.docker.io``, and a one-component repository there
    is under ``library/``."""
    name = ref.split("@", 1)[0]
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        host, path = first, rest
    else:
        host, path = DOCKER_HUB, name
    last = path.rsplit("/", 1)
    if ":" in last[-1]:
        path = path[: len(path) - len(last[-1])] + last[-1].split(":", 1)[0]
    host = registry_host(host)
    if host == DOCKER_HUB_REGISTRY and "/" not in path:
        path = "library/" + path
    return host, path


def _split_tag_digest(last: str, text: str) -> tuple[str, str | None, str | None]:
    """``NAME[:TAG][@DIGEST]`` -> (name, tag, digest)."""
    name, at, digest = last.partition("@")
    if at:
        if not _DIGEST.fullmatch(digest):
            raise InvalidReferenceError(
                f"invalid digest {digest!r} in {text!r}: expected sha256:<64 hex>"
            )
    name, colon, tag = name.partition(":")
    if colon:
        check_tag(tag, text)
        tag_or_none: str | None = tag
    else:
        tag_or_none = None if at else DEFAULT_TAG
    return name, tag_or_none, (digest if at else None)


def _parse_dir(path: str, text: str) -> ImageRef:
    store, slash, last = path.rpartition("/")
    if not slash or not last:
        raise InvalidReferenceError(
            f"reference {text!r} names no store: use /path/to/store/NAME[:TAG]"
        )
    name, tag, digest = _split_tag_digest(last, text)
    check_name_component(name, text)
    return ImageRef(store or "/", name, tag, digest)


def _parse_s3(rest: str, text: str) -> ImageRef:
    parts = rest.split("/")
    if len(parts) < 2 or not parts[-1]:
        raise InvalidReferenceError(
            f"S3 reference {text!r} must be s3://BUCKET[/PREFIX]/NAME[:TAG]"
        )
    bucket, prefix, last = parts[0], parts[1:-1], parts[-1]
    if not _BUCKET.fullmatch(bucket):
        raise InvalidReferenceError(f"invalid S3 bucket name {bucket!r} in {text!r}")
    if any(p in ("", ".", "..") for p in prefix):
        raise InvalidReferenceError(f"empty or relative prefix component in {text!r}")
    name, tag, digest = _split_tag_digest(last, text)
    check_name_component(name, text)
    store = "s3://" + "/".join([bucket, *prefix])
    return ImageRef(store, name, tag, digest)


def _parse_docker(rest: str, text: str) -> ImageRef:
    host, slash, path = rest.partition("/")
    if not slash or not host or not path:
        raise InvalidReferenceError(
            f"registry reference {text!r} must be docker://HOST[:PORT]/REPOSITORY[:TAG]"
        )
    if not _HOST.fullmatch(host):
        raise InvalidReferenceError(f"invalid registry host {host!r} in {text!r}")
    components = path.split("/")
    repo_components, last = components[:-1], components[-1]
    name, tag, digest = _split_tag_digest(last, text)
    for c in [*repo_components, name]:
        check_name_component(c, text)
    repository = "/".join([*repo_components, name])
    if len(repository) > 255:
        raise InvalidReferenceError(f"repository name in {text!r} is longer than 255 characters")
    return ImageRef(f"docker://{host}", repository, tag, digest)


def _in(text: str) -> str:
    return f" in {text!r}" if text else ""
