"""The quality gate (``runtime evaluate``): does a candidate checkpoint behave like the reference?

For each prompt, both models decode greedily; then both score the *reference's* continuation
with teacher forcing (one forward pass over prompt + continuation). Reported:

* exact-match rate: share of prompts whose greedy token sequences are identical;
* token agreement: share of continuation positions where both models' top-1 tokens agree,
  under the same teacher-forced context (so a model compared with itself scores exactly 1);
* log-prob gap: mean |log p_ref(t) - log p_cand(t)| over the reference's tokens, in nats.

``gate`` (pure) turns the metrics into pass/fail against ``GateThresholds``; CI of a model
release fails on a non-zero exit of ``runtime evaluate``.

Models run behind ``Backend``: ``TransformersBackend`` on CPU (FP8 weights dequantized, FP8
activations emulated: ``runtime.loader``), or ``OpenAIBackend`` against a vLLM server: one
already running (``runtime serve``), or one that ``evaluate`` starts for each side in turn
with the launcher's ``running_engine`` (GPU, or vLLM's CPU backend), so only one model is
loaded at a time. Both models share one tokenizer.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .errors import EvaluationError
from .prompts import Prompt

if TYPE_CHECKING:
    from .launch import ServeConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateThresholds:
    """Release criteria. Defaults suit FP8 W8A8 of a small model on short greedy outputs."""

    min_exact_match: float = 0.90
    min_token_agreement: float = 0.97
    max_logprob_gap: float = 0.10  # nats per token


@dataclass(frozen=True)
class EvalConfig:
    max_new_tokens: int = 48
    dtype: str | None = None  # compute dtype on CPU; None: the checkpoint's
    emulate_activations: bool = True
    thresholds: GateThresholds = GateThresholds()


@dataclass(frozen=True)
class Scores:
    """Teacher-forced scores of a continuation: per position, the log-prob of the given token
    and the model's own top-1 token."""

    logprobs: tuple[float, ...]
    top1: tuple[int, ...]


class Backend(Protocol):
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation token ids (without the prompt), stopping at EOS."""

    def score(self, prompt_ids: list[int], continuation: list[int]) -> Scores: ...


@dataclass(frozen=True)
class PromptResult:
    id: str
    reference: str
    candidate: str
    exact: bool
    tokens: int
    agreement: float
    logprob_gap: float


@dataclass(frozen=True)
class EvalReport:
    prompts: int
    exact_match: float
    token_agreement: float
    logprob_gap: float
    passed: bool
    failures: tuple[str, ...]
    thresholds: GateThresholds
    results: tuple[PromptResult, ...] = field(default=())

    def to_dict(self) -> dict:
        return asdict(self)


def gate(
    exact_match: float, token_agreement: float, logprob_gap: float, t: GateThresholds
) -> tuple[str, ...]:
    """Reasons the candidate fails the gate; empty when it passes."""
    fails = []
    if exact_match < t.min_exact_match:
        fails.append(f"exact match {exact_match:.3f} < {t.min_exact_match}")
    if token_agreement < t.min_token_agreement:
        fails.append(f"token agreement {token_agreement:.3f} < {t.min_token_agreement}")
    if not logprob_gap <= t.max_logprob_gap:  # NaN fails too
        fails.append(f"log-prob gap {logprob_gap:.4f} > {t.max_logprob_gap}")
    return tuple(fails)


@dataclass(frozen=True)
class SideRun:
    """One model's part of the gate, per prompt: its greedy output and its teacher-forced
    scores of the reference's output (``None`` where that output is empty)."""

    outputs: tuple[tuple[int, ...], ...]
    scores: tuple[Scores | None, ...]


def run_side(
    backend: Backend,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    ref_outputs: tuple[tuple[int, ...], ...] | None = None,
) -> SideRun:
    """Run one model over every prompt. The reference scores its own outputs; a candidate
    scores the reference's (``ref_outputs``). One model at a time, so the two sides can run
    one after the other on one machine (an engine each)."""
    outputs, scores = [], []
    for i, ids in enumerate(prompt_ids):
        out = tuple(backend.generate(ids, max_new_tokens))
        target = out if ref_outputs is None else ref_outputs[i]
        outputs.append(out)
        scores.append(backend.score(ids, list(target)) if target else None)
    return SideRun(outputs=tuple(outputs), scores=tuple(scores))


def report(
    prompts: list[Prompt], ref: SideRun, cand: SideRun, decode, config: EvalConfig
) -> EvalReport:
    """The metrics and the gate's verdict from both sides' runs (pure)."""
    results = []
    agree_n = tok_n = 0
    gap_sum = 0.0
    for p, r_out, c_out, rs, cs in zip(
        prompts, ref.outputs, cand.outputs, ref.scores, cand.scores, strict=True
    ):
        if r_out:
            agree = sum(a == b for a, b in zip(rs.top1, cs.top1, strict=True))
            gap = sum(abs(a - b) for a, b in zip(rs.logprobs, cs.logprobs, strict=True))
        else:
            agree, gap = 0, 0.0
        agree_n += agree
        tok_n += len(r_out)
        gap_sum += gap
        results.append(
            PromptResult(
                id=p.id,
                reference=decode(list(r_out)),
                candidate=decode(list(c_out)),
                exact=r_out == c_out,
                tokens=len(r_out),
                agreement=agree / len(r_out) if r_out else 1.0,
                logprob_gap=gap / len(r_out) if r_out else 0.0,
            )
        )
        log.debug("%s: exact=%s agreement=%d/%d", p.id, r_out == c_out, agree, len(r_out))
    exact = sum(r.exact for r in results) / len(results)
    agreement = agree_n / tok_n if tok_n else 1.0
    gap = gap_sum / tok_n if tok_n else 0.0
    if math.isnan(gap):
        gap = math.inf
    failures = gate(exact, agreement, gap, config.thresholds)
    return EvalReport(
        prompts=len(results),
        exact_match=exact,
        token_agreement=agreement,
        logprob_gap=gap,
        passed=not failures,
        failures=failures,
        thresholds=config.thresholds,
        results=tuple(results),
    )


def compare(
    ref: Backend,
    cand: Backend,
    encode,
    decode,
    prompts: list[Prompt],
    config: EvalConfig = EvalConfig(),
) -> EvalReport:
    """Run the gate with two backends; ``encode``/``decode`` are the shared tokenizer's."""
    if not prompts:
        raise EvaluationError("no prompts")
    ids = [encode(p.prompt) for p in prompts]
    r = run_side(ref, ids, config.max_new_tokens)
    c = run_side(cand, ids, config.max_new_tokens, r.outputs)
    return report(prompts, r, c, decode, config)


class TransformersBackend:
    """A causal LM run with transformers on CPU."""

    def __init__(self, model, eos_token_id: int | list[int] | None, pad_token_id: int | None):
        self.model = model
        self.eos = eos_token_id
        self.pad = pad_token_id

    @classmethod
    def load(cls, model_dir: Path, config: EvalConfig) -> TransformersBackend:
        from .loader import LoadConfig, load_model

        model = load_model(
            model_dir,
            LoadConfig(dtype=config.dtype, emulate_activations=config.emulate_activations),
        )
        gc = model.generation_config
        return cls(model, gc.eos_token_id, gc.pad_token_id)

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        import torch

        x = torch.tensor([prompt_ids])
        with torch.inference_mode():
            out = self.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=self.eos,
                pad_token_id=self.pad,
            )
        return out[0, len(prompt_ids) :].tolist()

    def score(self, prompt_ids: list[int], continuation: list[int]) -> Scores:
        import torch

        x = torch.tensor([prompt_ids + continuation])
        n = len(prompt_ids)
        with torch.inference_mode():
            logits = self.model(x).logits[0, n - 1 : n - 1 + len(continuation)].float()
        lp = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(continuation)
        return Scores(
            logprobs=tuple(lp.gather(1, target[:, None])[:, 0].tolist()),
            top1=tuple(lp.argmax(dim=-1).tolist()),
        )


class OpenAIBackend:
    """A model served by vLLM's OpenAI-compatible server (e.g. ``runtime serve``), over HTTP.

    Prompts go as token ids, so both sides see the same tokens; scores come from vLLM's
    ``prompt_logprobs`` (the given token's log-prob and the rank-1 token per position).
    """

    def __init__(self, url: str, model: str = "model", timeout: float = 300.0) -> None:
        import httpx

        self.model = model
        self.client = httpx.Client(base_url=url, timeout=timeout)

    def __enter__(self) -> OpenAIBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()

    def _complete(self, body: dict) -> dict:
        import httpx

        try:
            r = self.client.post("/v1/completions", json={"model": self.model, **body})
        except httpx.HTTPError as e:
            raise EvaluationError(f"{self.client.base_url}: {e}") from None
        if r.status_code != 200:
            raise EvaluationError(f"{self.client.base_url}: {r.status_code} {r.text[:200]}")
        return r.json()["choices"][0]

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        c = self._complete(
            {
                "prompt": prompt_ids,
                "max_tokens": max_new_tokens,
                "temperature": 0.0,
                "return_token_ids": True,
            }
        )
        return list(c["token_ids"])

    def score(self, prompt_ids: list[int], continuation: list[int]) -> Scores:
        ids = prompt_ids + continuation
        c = self._complete(
            {"prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1}
        )
        lps, top1 = [], []
        for pos in range(len(prompt_ids), len(ids)):
            entries = c["prompt_logprobs"][pos]
            lps.append(entries[str(ids[pos])]["logprob"])
            top1.append(int(next(k for k, v in entries.items() if v["rank"] == 1)))
        return Scores(logprobs=tuple(lps), top1=tuple(top1))


# Where a side's model runs: given its checkpoint, a ``ServeConfig`` for an engine to start.
LaunchFor = Callable[[Path], "ServeConfig"]


@contextlib.contextmanager
def _backend(
    model_dir: Path, url: str | None, launch: LaunchFor | None, config: EvalConfig, engine_out
) -> Iterator[Backend]:
    if url:
        with OpenAIBackend(url) as b:
            yield b
    elif launch:
        from .launch import running_engine

        cfg = launch(model_dir)
        log.info("starting an engine for %s", model_dir)
        with running_engine(cfg, stdout=engine_out) as eng:
            with OpenAIBackend(eng.url, cfg.engine.served_model_name) as b:
                yield b
    else:
        yield TransformersBackend.load(model_dir, config)


def evaluate(
    ref_dir: Path,
    cand_dir: Path,
    prompts: list[Prompt],
    config: EvalConfig = EvalConfig(),
    *,
    ref_url: str | None = None,
    cand_url: str | None = None,
    launch: LaunchFor | None = None,
    engine_out=None,
) -> EvalReport:
    """Compare two checkpoints. Each side runs, in turn (reference first), on the vLLM server
    at its URL if given (serving that side's checkpoint as model "model"); else, with
    ``launch``, on an engine started for it (``runtime.launch.running_engine``: ready after
    warm-up, stopped with all its processes when the side is done, errors and Ctrl-C
    included; ``engine_out`` gets its output); else with transformers on CPU."""
    from .loader import load_tokenizer

    if not prompts:
        raise EvaluationError("no prompts")
    tok = load_tokenizer(ref_dir)
    cand_tok = load_tokenizer(cand_dir)
    if tok.get_vocab() != cand_tok.get_vocab():
        raise EvaluationError("reference and candidate tokenizers differ")
    ids = [tok(p.prompt)["input_ids"] for p in prompts]
    with _backend(ref_dir, ref_url, launch, config, engine_out) as ref:
        r = run_side(ref, ids, config.max_new_tokens)
    with _backend(cand_dir, cand_url, launch, config, engine_out) as cand:
        c = run_side(cand, ids, config.max_new_tokens, r.outputs)
    return report(prompts, r, c, lambda t: tok.decode(t, skip_special_tokens=True), config)
