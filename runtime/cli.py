"""``runtime`` command line: options become config objects; errors become text and exit codes.

Exit codes are every lazyblock command's (``lazyblock.cli``): 0 success; 1 the quality gate
failed (``evaluate``) or the server stopped on an error (``serve``); 2 bad usage; 3 a
runtime error (``runtime: error: <Type>: <message>`` on stderr); 130 interrupted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
import signal
import sys
from pathlib import Path

import click

from lazyblock.cli import EXIT_CHECK_FAILED, ToolGroup

from .errors import RuntimeToolError

log = logging.getLogger("runtime")

_dir = click.Path(path_type=Path, file_okay=False)
_existing_dir = click.Path(path_type=Path, exists=True, file_okay=False)
_PYTHON_HELP = "Interpreter that has vLLM (default: this one, else runtime/.venv-vllm)."


@click.group("runtime", cls=ToolGroup, errors=(RuntimeToolError,))
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
def main(verbose: int) -> None:
    """lazyblock runtime: FP8 quantization, quality gate and vLLM launcher."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


@main.command()
@click.argument("model_dir", type=_existing_dir)
@click.argument("out_dir", type=_dir)
@click.option(
    "--keep-precision",
    "keep",
    multiple=True,
    metavar="PATTERN",
    help="Linear modules kept in original precision: a glob, or re:REGEX; {first}/{last} "
    "stand for the first/last block (e.g. 'model.layers.{last}.*', '*.self_attn.*'). "
    "lm_head is always kept. Repeatable.",
)
@click.option("--overwrite", is_flag=True, help="Replace OUT_DIR if it exists.")
def quantize(model_dir: Path, out_dir: Path, keep: tuple[str, ...], overwrite: bool) -> None:
    """Write an FP8 (E4M3, per-channel) compressed-tensors copy of MODEL_DIR to OUT_DIR."""
    from .quantize import QuantizeConfig, quantize_checkpoint

    r = quantize_checkpoint(model_dir, out_dir, QuantizeConfig(keep=keep, overwrite=overwrite))
    click.echo(
        f"{r.out_dir}: {len(r.quantized)} Linear layers in FP8, {len(r.kept)} kept "
        f"({r.bytes_in / 2**20:.1f} MiB -> {r.bytes_out / 2**20:.1f} MiB)"
    )


@main.command()
@click.argument("ref_dir", type=_existing_dir)
@click.argument("candidate_dir", type=_existing_dir)
@click.option(
    "--data",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="JSONL prompts (default: the shipped grammar-correction set).",
)
@click.option("--limit", type=int, default=None, help="Use only the first N prompts.")
@click.option("--max-new-tokens", type=int, default=48, show_default=True)
@click.option("--dtype", default=None, help="CPU compute dtype (default: the checkpoint's).")
@click.option("--min-exact-match", type=float, default=0.90, show_default=True)
@click.option("--min-token-agreement", type=float, default=0.97, show_default=True)
@click.option("--max-logprob-gap", type=float, default=0.10, show_default=True)
@click.option("--weights-only", is_flag=True, help="Do not emulate FP8 activations on CPU.")
@click.option("--threads", type=int, default=None, help="torch CPU threads.")
@click.option("--ref-url", default=None, help="Score the reference on this vLLM server.")
@click.option("--candidate-url", default=None, help="Score the candidate on this vLLM server.")
@click.option(
    "--engine",
    type=click.Choice(["transformers", "vllm"]),
    default="transformers",
    show_default=True,
    help="vllm: start vLLM (as `serve` would) for each side in turn, stop it when done.",
)
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="With --engine vllm: vLLM's GPU or CPU settings.")  # fmt: skip
@click.option("--python", "python_", default=None, help=_PYTHON_HELP)
@click.option("--startup-timeout", type=float, default=900.0, show_default=True)
@click.option("--engine-log", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="vLLM's output (default: stderr).")  # fmt: skip
@click.option("--report", type=click.Path(path_type=Path, dir_okay=False), default=None)
def evaluate(
    ref_dir: Path,
    candidate_dir: Path,
    data: Path | None,
    limit: int | None,
    max_new_tokens: int,
    dtype: str | None,
    min_exact_match: float,
    min_token_agreement: float,
    max_logprob_gap: float,
    weights_only: bool,
    threads: int | None,
    ref_url: str | None,
    candidate_url: str | None,
    engine: str,
    device: str,
    python_: str | None,
    startup_timeout: float,
    engine_log: Path | None,
    report: Path | None,
) -> None:
    """Quality gate: compare CANDIDATE_DIR with REF_DIR; exit 1 if it fails."""
    from .evaluate import EvalConfig, GateThresholds
    from .evaluate import evaluate as run_eval
    from .prompts import DEFAULT_PROMPTS, load_prompts

    if threads:
        import torch

        torch.set_num_threads(threads)
    prompts = load_prompts(data or DEFAULT_PROMPTS)[:limit]
    cfg = EvalConfig(
        max_new_tokens=max_new_tokens,
        dtype=dtype,
        emulate_activations=not weights_only,
        thresholds=GateThresholds(min_exact_match, min_token_agreement, max_logprob_gap),
    )
    launch = None
    if engine == "vllm":
        from .launch import vllm_python

        launch = _eval_launcher(device, python_ or vllm_python(), startup_timeout)
    # SIGTERM unwinds like Ctrl-C, so a started engine is stopped on the way out; Ctrl-C
    # too when started from a shell that ignores SIGINT for background jobs.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(engine_log.open("ab")) if engine_log else sys.stderr
        r = run_eval(
            ref_dir,
            candidate_dir,
            prompts,
            cfg,
            ref_url=ref_url,
            cand_url=candidate_url,
            launch=launch,
            engine_out=out,
        )
    if report:
        report.write_text(json.dumps(r.to_dict(), indent=2) + "\n")
    click.echo(
        f"prompts {r.prompts}  exact match {r.exact_match:.3f}  token agreement "
        f"{r.token_agreement:.4f}  log-prob gap {r.logprob_gap:.4f} nats/token"
    )
    if r.passed:
        click.echo("PASS")
        return
    for f in r.failures:
        click.echo(f"FAIL: {f}")
    sys.exit(EXIT_CHECK_FAILED)


def _exit_on_sigterm(signum, frame) -> None:
    sys.exit(128 + signum)


def _eval_launcher(device: str, python: str, startup_timeout: float):
    """The engine for one side of ``evaluate --engine vllm``: ``serve``'s settings on a free
    loopback port, a small warm-up."""
    from .launch import EngineConfig, FrontConfig, ServeConfig, free_port

    def launch(model_dir: Path) -> ServeConfig:
        if device == "cpu":
            engine = EngineConfig.for_cpu(model_dir, python=python)
        else:
            engine = EngineConfig(model_dir=model_dir, python=python)
        front = FrontConfig(
            engine_port=free_port(), startup_timeout_s=startup_timeout, warmup_requests=2
        )
        return ServeConfig(engine=engine, front=front)

    return launch


@main.command()
@click.argument("model_dir", type=_existing_dir)
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--engine-port", type=int, default=8100, show_default=True)
@click.option("--served-model-name", default="model", show_default=True)
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--python", "python_", default=None, help=_PYTHON_HELP)
@click.option("--api-server-count", type=int, default=None)
@click.option("--max-num-seqs", type=int, default=None)
@click.option("--max-model-len", type=int, default=None)
@click.option("--enforce-eager/--cuda-graphs", default=None)
@click.option("--warmup-requests", type=int, default=8, show_default=True)
@click.option("--startup-timeout", type=float, default=900.0, show_default=True)
@click.option("--drain-grace", type=float, default=0.0, show_default=True,
              help="Seconds /ready is 503 before the front stops accepting.")  # fmt: skip
@click.option("--drain-timeout", type=float, default=60.0, show_default=True)
@click.option(
    "--engine-command",
    default=None,
    help="Another OpenAI-compatible engine; {host} {port} {model} {name} are substituted.",
)
@click.option("--print-command", is_flag=True, help="Print the vLLM command line and exit.")
@click.argument("extra_args", nargs=-1, type=click.UNPROCESSED)
def serve(
    model_dir: Path,
    host: str,
    port: int,
    engine_port: int,
    served_model_name: str,
    device: str,
    python_: str | None,
    api_server_count: int | None,
    max_num_seqs: int | None,
    max_model_len: int | None,
    enforce_eager: bool | None,
    warmup_requests: int,
    startup_timeout: float,
    drain_grace: float,
    drain_timeout: float,
    engine_command: str | None,
    print_command: bool,
    extra_args: tuple[str, ...],
) -> None:
    """Serve MODEL_DIR with vLLM behind a readiness/drain front. Extra args go to vLLM."""
    from .launch import EngineConfig, FrontConfig, ServeConfig
    from .launch import engine_command as build
    from .launch import serve as run_serve

    overrides = {
        k: v
        for k, v in {
            "api_server_count": api_server_count,
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len,
            "enforce_eager": enforce_eager,
        }.items()
        if v is not None
    }
    common = dict(
        served_model_name=served_model_name, python=python_, extra_args=extra_args, **overrides
    )
    if device == "cpu":
        engine = EngineConfig.for_cpu(model_dir, **common)
    else:
        engine = EngineConfig(model_dir=model_dir, **common)
    front = FrontConfig(
        host=host,
        port=port,
        engine_port=engine_port,
        startup_timeout_s=startup_timeout,
        warmup_requests=warmup_requests,
        drain_grace_s=drain_grace,
        drain_timeout_s=drain_timeout,
    )
    if print_command:
        click.echo(shlex.join(build(engine, front.engine_host, front.engine_port)))
        return
    cfg = ServeConfig(
        engine=engine,
        front=front,
        engine_command=tuple(shlex.split(engine_command)) if engine_command else None,
    )
    sys.exit(run_serve(cfg))


@main.command("warm-up")
@click.argument("url", default="http://127.0.0.1:8000")
@click.option("--requests", "n", type=int, default=8, show_default=True)
@click.option("--timeout", type=float, default=60.0, show_default=True,
              help="Seconds to wait for /health before failing.")  # fmt: skip
@click.option("--served-model-name", default="model", show_default=True)
def warm_up(url: str, n: int, timeout: float, served_model_name: str) -> None:
    """Wait for the vLLM server at URL to be healthy, then send it a warm-up batch; exit 0 when
    it went through. For vLLM owning the port without `serve`'s front (a startup probe)."""
    from .launch import FrontConfig
    from .launch import warm_up as run_warm_up

    run_warm_up(url, FrontConfig(startup_timeout_s=timeout, warmup_requests=n), served_model_name)
    click.echo("warm")


@main.command("build-image")
@click.argument("base", type=_existing_dir)
@click.argument("model_dir", type=_existing_dir)
@click.argument("out", type=_dir)
@click.option("--layer", "extra", multiple=True, metavar="SRC:DEST",
              help="Another directory layer, added before the model's. Repeatable.")  # fmt: skip
@click.option("--model-path", default="models/model", show_default=True)
@click.option("--tag", default="latest", show_default=True)
def build_image(
    base: Path, model_dir: Path, out: Path, extra: tuple[str, ...], model_path: str, tag: str
) -> None:
    """Write OUT: the BASE OCI layout plus MODEL_DIR as its own layer (offline, no daemon)."""
    from .image import ImageSpec, Layer, build_layout

    layers = []
    for item in extra:
        src, sep, dest = item.partition(":")
        if not sep:
            raise click.BadParameter(f"{item!r}: expected SRC:DEST", param_hint="--layer")
        layers.append(Layer(Path(src), dest))
    layers.append(Layer(model_dir, model_path, comment="model weights"))
    digest = build_layout(base, out, ImageSpec(layers=tuple(layers), ref_name=tag))
    click.echo(f"{out}: {digest}")


@main.command("make-tiny-model")
@click.argument("out_dir", type=_dir)
@click.option("--seed", type=int, default=0, show_default=True)
def make_tiny_model(out_dir: Path, seed: int) -> None:
    """Write a tiny random Llama checkpoint (locally trained tokenizer) for tests."""
    from .tiny import TinyModelConfig
    from .tiny import make_tiny_model as make

    click.echo(make(out_dir, TinyModelConfig(seed=seed)))


if __name__ == "__main__":
    main()
