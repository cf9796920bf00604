"""A minimal reader of the Prometheus text format: sums of named samples (for vLLM /metrics)."""

from __future__ import annotations


def sum_samples(text: str, names: frozenset[str] | set[str]) -> dict[str, float]:
    """Sum every sample of each metric in ``names`` over all label sets.

    Only what the router and autoscaler need: ``name{labels} value [timestamp]`` lines;
    comments and other metrics are skipped. Missing metrics are absent from the result.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            rest = line[line.rfind("}") + 1 :]
        else:
            name = line[:space] if space != -1 else line
            rest = line[space:] if space != -1 else ""
        if name not in names:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out


VLLM_LOAD = frozenset({"vllm:num_requests_running", "vllm:num_requests_waiting"})


def vllm_load(text: str) -> float | None:
    """running + waiting from a vLLM /metrics page, or None if neither metric is there."""
    s = sum_samples(text, VLLM_LOAD)
    if not s:
        return None
    return sum(s.values())
