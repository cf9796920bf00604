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
activations emulated: ``runtime.loader``), or ``OpenAIBackend`` against a vLLM server that
``runtime serve`` started (GPU, or vLLM's CPU backend). Both models share one tokenizer.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from .errors import EvaluationError
from .prompts import Prompt

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
    results = []
    agree_n = tok_n = 0
    gap_sum = 0.0
    for p in prompts:
        ids = encode(p.prompt)
        r_out = ref.generate(ids, config.max_new_tokens)
        c_out = cand.generate(ids, config.max_new_tokens)
        if r_out:
            rs, cs = ref.score(ids, r_out), cand.score(ids, r_out)
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
                reference=decode(r_out),
                candidate=decode(c_out),
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


def evaluate(
    ref_dir: Path,
    cand_dir: Path,
    prompts: list[Prompt],
    config: EvalConfig = EvalConfig(),
    *,
    ref_url: str | None = None,
    cand_url: str | None = None,
) -> EvalReport:
    """Compare two checkpoints: on CPU with transformers, or, for a side given a URL, with
    the vLLM server there (serving that side's checkpoint as model "model")."""
    from .loader import load_tokenizer

    tok = load_tokenizer(ref_dir)
    cand_tok = load_tokenizer(cand_dir)
    if tok.get_vocab() != cand_tok.get_vocab():
        raise EvaluationError("reference and candidate tokenizers differ")
    ref = OpenAIBackend(ref_url) if ref_url else TransformersBackend.load(ref_dir, config)
    cand = OpenAIBackend(cand_url) if cand_url else TransformersBackend.load(cand_dir, config)
    return compare(
        ref,
        cand,
        lambda s: tok(s)["input_ids"],
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        prompts,
        config,
    )
