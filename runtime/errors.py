"""The runtime exception tree. Every error the runtime raises derives from ``RuntimeToolError``.

    RuntimeToolError
    ├── CheckpointError (ValueError)     a model directory that is missing, malformed or
    │                                    in a format we do not handle (no safetensors, ...)
    ├── QuantizationError (ValueError)   a quantization request that cannot be honoured
    │                                    (bad pattern, fused layers split across precisions)
    ├── EvaluationError                  the quality gate could not run (bad prompt file, ...)
    └── LaunchError                      the serving engine failed to start, warm up or stop

Errors become text only at the CLI edge (``runtime.cli``).
"""

from __future__ import annotations


class RuntimeToolError(Exception):
    """Base class of every runtime error."""


class CheckpointError(RuntimeToolError, ValueError):
    """A model checkpoint directory that is missing, malformed or unsupported."""


class QuantizationError(RuntimeToolError, ValueError):
    """A quantization request that cannot be honoured."""


class EvaluationError(RuntimeToolError):
    """The quality gate could not be run."""


class LaunchError(RuntimeToolError):
    """The serving engine failed to start, warm up or stop."""
