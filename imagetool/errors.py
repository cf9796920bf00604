"""The imagetool exception tree. Every error imagetool raises derives from ``ImageToolError``.

    ImageToolError
    ├── InvalidSourceError (ValueError)   bad source image: corrupt tar/gzip, bad manifest, ...
    │   ├── UnsafePathError               tar entry escaping the root (.., absolute, via symlink)
    │   ├── UnsupportedMediaTypeError     a media type imagetool does not know
    │   └── DigestMismatchError           content does not match its digest
    ├── FormatError (ValueError)          a block image index that is malformed or unsupported
    │   └── ErofsError                    a malformed or unsupported EROFS image
    ├── ChecksumError                     a sector whose bytes do not match the index
    ├── InvalidReferenceError (ValueError) a store or image reference that cannot be parsed
    ├── HostsConfigError (ValueError)     a malformed registry hosts directory (hosts.toml)
    └── StoreError                        a store failed (I/O, network, refused)
        ├── NotFoundError (KeyError)      a blob, tag or image that does not exist
        ├── AuthError                     the store refused our credentials
        └── StoreTimeoutError (TimeoutError) the store did not answer in time

Errors become text only at the CLI edge (``imagetool.cli``).
"""

from __future__ import annotations


class ImageToolError(Exception):
    """Base class of every imagetool error."""


class InvalidSourceError(ImageToolError, ValueError):
    """The source image is malformed."""


class ProfileError(ImageToolError, ValueError):
    """A startup profile (``convert --profile``) that is not a list of paths."""


class UnsafePathError(InvalidSourceError):
    """A layer entry would escape the image root."""


class UnsupportedMediaTypeError(InvalidSourceError):
    """A media type we do not understand."""


class DigestMismatchError(InvalidSourceError):
    """Content does not hash to the digest that names it."""


class FormatError(ImageToolError, ValueError):
    """A block image index that is malformed or of an unsupported version."""


class ChecksumError(ImageToolError):
    """A sector's bytes do not match the checksum recorded in the index."""


class InvalidReferenceError(ImageToolError, ValueError):
    """An image or store reference that cannot be parsed."""


class HostsConfigError(ImageToolError, ValueError):
    """A registry hosts directory (containerd's ``hosts.toml``) that is malformed."""


class StoreError(ImageToolError):
    """A store operation failed."""


class NotFoundError(StoreError, KeyError):
    """A blob, tag or image that does not exist in the store."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "not found"


class AuthError(StoreError):
    """The store refused our credentials."""


class StoreTimeoutError(StoreError, TimeoutError):
    """The store did not answer in time."""


class ErofsError(FormatError):
    """An EROFS image that is malformed or uses a feature the reader does not support."""
