"""The serving exception tree. Every error the serving package raises derives from ``ServingError``.

    ServingError
    ├── ConfigError (ValueError)          a bad option, endpoint list or policy
    ├── NoBackendError                    the router has no backend it may send a request to
    ├── ProtocolError                     a peer sent a malformed HTTP message (``status``)
    ├── DiscoveryError                    an endpoint source failed (file, Kubernetes, EDS stream)
    └── ActuatorError                     scaling could not be applied (Kubernetes, process pool)

Errors become text only at the CLI edge (``serving.cli``).
"""

from __future__ import annotations


class ServingError(Exception):
    """Base class of every serving error."""


class ConfigError(ServingError, ValueError):
    """A configuration value or endpoint description is invalid."""


class NoBackendError(ServingError):
    """No backend is eligible for a request."""


class DiscoveryError(ServingError):
    """An endpoint source failed."""


class ActuatorError(ServingError):
    """Scaling could not be applied."""


class ProtocolError(ServingError):
    """A client or backend sent an HTTP message the router will not pass on.

    ``status`` is what the router answers: 4xx/5xx for a client's request, 502 for a
    backend's response.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
