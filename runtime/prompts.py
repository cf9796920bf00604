"""Prompt sets for the quality gate: JSONL, one ``{"id", "prompt", ...}`` object per line.

``DEFAULT_PROMPTS`` is the shipped grammar-correction set (``data/grammar_prompts.jsonl``):
each record also has the ``source`` sentence and its corrected ``target``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import EvaluationError

DEFAULT_PROMPTS = Path(__file__).parent / "data" / "grammar_prompts.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str
    target: str = ""


def load_prompts(path: Path = DEFAULT_PROMPTS) -> list[Prompt]:
    """Read a JSONL prompt file; blank lines are skipped."""
    out: list[Prompt] = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise EvaluationError(f"{path}: {e.strerror or e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out.append(
                Prompt(id=str(rec.get("id", n)), prompt=rec["prompt"], target=rec.get("target", ""))
            )
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise EvaluationError(f"{path}:{n}: bad prompt record ({e})") from None
    if not out:
        raise EvaluationError(f"{path}: no prompts")
    return out
