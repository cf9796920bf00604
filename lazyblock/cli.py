"""The edge of every lazyblock command: errors become one line and an exit code.

The same in ``imagetool``, ``snapshotter``, ``serving`` and ``runtime``:

    0    success
    1    a check failed: ``imagetool verify`` found differences, ``snapshotter check`` a
         node that cannot pull lazily, ``runtime evaluate``'s quality gate failed (the
         command says what, then exits 1)
    2    usage: a bad option or argument (Click's message, with the usage line)
    3    an error of the tool, or of a local file: one line on stderr,
         ``PROG: error: Kind: message``
    130  interrupted (Ctrl-C; a command that handles SIGTERM stops the same way)

A tool's command group is a ``ToolGroup`` that knows its own error types (the base class of
its exceptions); libraries below the edge raise those and never print or exit.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import click

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_ERROR = 3
EXIT_INTERRUPTED = 130


def one_line(error: BaseException) -> str:
    """An error's message on one line (its type's name if it has none)."""
    return " ".join(str(error).split()) or type(error).__name__


def error_line(prog: str, error: BaseException) -> str:
    """``PROG: error: Kind: message``, what every tool prints for an error."""
    return f"{prog}: error: {type(error).__name__}: {one_line(error)}"


class ToolGroup(click.Group):
    """A tool's top command group; ``errors``: its exception types, which (with ``OSError``,
    a local file missing, unreadable or out of space) become exit code 3."""

    def __init__(
        self, *args: Any, errors: tuple[type[BaseException], ...] = (), **kwargs: Any
    ) -> None:
        kwargs.setdefault("context_settings", {"help_option_names": ["-h", "--help"]})
        super().__init__(*args, **kwargs)
        self.errors = errors

    def main(  # type: ignore[override]
        self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any
    ) -> NoReturn:
        prog = prog_name or self.name or "lazyblock"
        extra.pop("standalone_mode", None)
        try:
            result = super().main(args=args, prog_name=prog, standalone_mode=False, **extra)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except (click.Abort, KeyboardInterrupt):
            click.echo(f"{prog}: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:  # the reader of our output went away: nothing to say
            sys.exit(EXIT_OK)
        except (*self.errors, OSError) as e:
            click.echo(error_line(prog, e), err=True)
            sys.exit(EXIT_ERROR)
        sys.exit(result if type(result) is int else EXIT_OK)
