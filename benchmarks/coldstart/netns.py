"""The benchmark's "remote" host: a network namespace behind a shaped veth link.

Owns everything network-side of the cold-start benchmark:

* a namespace (default ``lbbench``) joined to the host by a veth pair with a /30 between
  them (host ``10.213.77.1``, remote ``10.213.77.2``); traffic never leaves the machine;
* bandwidth: ``tc`` token bucket (tbf) on *both* ends' egress, so the link is symmetric;
* delay: this kernel has no ``netem``, so packets *entering* the namespace are queued to
  user space with the iptables ``NFQUEUE`` target (``nft queue`` is not built either) and
  released by a small handler (``DelayLine`` + ``run_delay``, run inside the namespace
  because netlink queues are per namespace) after the full RTT. Delaying one direction by
  the whole RTT gives TCP the same round trip as splitting it; only the direction carrying
  requests and ACKs (few, small packets) goes through Python, the data does not;
* the registry (Debian's ``docker-registry``) started inside the namespace; its access log
  gives response body bytes, and the host veth's ``rx_bytes`` gives bytes on the wire.

Teardown is idempotent and also cleans up after a crashed run: processes left in the
namespace (ours: only this module starts any) are killed by pid, then the namespace and
the host end of the veth are deleted.

The pure parts (presets, tbf sizing, command lists, the delay line, access-log parsing) are
tested without root in ``tests/coldstart/test_netns.py``.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Generic, TypeVar

log = logging.getLogger("coldstart.netns")

T = TypeVar("T")


@dataclass(frozen=True)
class Preset:
    """A network profile between the node and the registry."""

    name: str
    rate_mbit: float | None  # None: no bandwidth limit
    rtt_ms: float  # 0: no added delay

    @property
    def shaped(self) -> bool:
        return self.rate_mbit is not None or self.rtt_ms > 0


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("1g-1ms", 1000.0, 1.0),  # same-region registry / pull-through cache
        Preset("200m-20ms", 200.0, 20.0),  # cross-region registry
        Preset("none", None, 0.0),  # CI smoke test: veth only
        # bandwidth only: where the mount benchmark's cold reads stop keeping up with the link
        Preset("2g", 2000.0, 0.0),
        Preset("4g", 4000.0, 0.0),
        Preset("10g", 10000.0, 0.0),  # a GPU node's slower NICs (whether tbf keeps up: see it)
    )
}


@dataclass(frozen=True)
class NetConfig:
    """Names and addresses of the remote host. Interface names stay under IFNAMSIZ (15)."""

    namespace: str = "lbbench"
    host_if: str = "lbb-host"
    remote_if: str = "lbb-remote"
    host_addr: str = "10.213.77.1"
    remote_addr: str = "10.213.77.2"
    prefix_len: int = 30
    queue_num: int = 7213  # NFQUEUE number inside the namespace (any unused 16-bit number)


@dataclass(frozen=True)
class TbfParams:
    rate_bit: int
    burst_bytes: int
    limit_bytes: int


# tbf's bucket must hold at least one GSO super-packet (64 KiB) or it segments them, and at
# least a timer tick's worth of tokens to reach its rate; 2 ms of tokens covers both at 1G.
MIN_BURST = 128 << 10
BURST_SECONDS = 0.002
# Queue in front of the bucket: 50 ms at line rate, like a switch buffer; TCP fills it
# rather than losing packets, so the throughput reached is the configured rate.
QUEUE_SECONDS = 0.05


def tbf_params(rate_mbit: float) -> TbfParams:
    """Token bucket sizes for ``rate_mbit`` (megabits per second, 10^6)."""
    if rate_mbit <= 0:
        raise ValueError(f"rate must be positive, not {rate_mbit}")
    rate_bit = int(rate_mbit * 1_000_000)
    bytes_per_s = rate_bit / 8
    burst = max(MIN_BURST, int(bytes_per_s * BURST_SECONDS))
    return TbfParams(rate_bit, burst, burst + int(bytes_per_s * QUEUE_SECONDS))


def _in_ns(cfg: NetConfig, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", cfg.namespace, *cmd]


def setup_commands(cfg: NetConfig) -> list[list[str]]:
    """Create the namespace and the link, addressed and up (no shaping)."""
    cidr = f"/{cfg.prefix_len}"
    return [
        ["ip", "netns", "add", cfg.namespace],
        ["ip", "link", "add", cfg.host_if, "type", "veth", "peer", "name", cfg.remote_if],
        ["ip", "link", "set", cfg.remote_if, "netns", cfg.namespace],
        ["ip", "addr", "add", cfg.host_addr + cidr, "dev", cfg.host_if],
        ["ip", "link", "set", cfg.host_if, "up"],
        _in_ns(cfg, "ip", "addr", "add", cfg.remote_addr + cidr, "dev", cfg.remote_if),
        _in_ns(cfg, "ip", "link", "set", cfg.remote_if, "up"),
        _in_ns(cfg, "ip", "link", "set", "lo", "up"),
    ]


def shaping_commands(cfg: NetConfig, preset: Preset) -> list[list[str]]:
    """Replace the link's shaping with ``preset``'s: tbf both ways, NFQUEUE rule for delay.

    Starts from a clean state (root qdiscs deleted, mangle PREROUTING flushed), so applying
    presets one after another is safe; the delay handler itself is ``RemoteHost``'s job."""
    cmds: list[list[str]] = [
        # "|| true" semantics: deleting a default qdisc fails harmlessly; see run_commands.
        ["-", "tc", "qdisc", "del", "dev", cfg.host_if, "root"],
        ["-", *_in_ns(cfg, "tc", "qdisc", "del", "dev", cfg.remote_if, "root")],
        _in_ns(cfg, "iptables", "-t", "mangle", "-F", "PREROUTING"),
    ]
    if preset.rate_mbit is not None:
        p = tbf_params(preset.rate_mbit)
        tbf = ["tbf", "rate", f"{p.rate_bit}bit", "burst", str(p.burst_bytes),
               "limit", str(p.limit_bytes)]  # fmt: skip
        cmds.append(["tc", "qdisc", "add", "dev", cfg.host_if, "root", *tbf])
        cmds.append(_in_ns(cfg, "tc", "qdisc", "add", "dev", cfg.remote_if, "root", *tbf))
    if preset.rtt_ms > 0:
        cmds.append(
            _in_ns(
                cfg,
                "iptables",
                "-t",
                "mangle",
                "-A",
                "PREROUTING",
                "-i",
                cfg.remote_if,
                "-j",
                "NFQUEUE",
                "--queue-num",
                str(cfg.queue_num),
            )  # fmt: skip
        )
    return cmds


def run_commands(cmds: Iterable[list[str]]) -> None:
    """Run commands in order; one starting with ``"-"`` may fail (its error is ignored)."""
    for cmd in cmds:
        optional = cmd[0] == "-"
        argv = cmd[1:] if optional else cmd
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0 and not optional:
            raise NetError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")


class NetError(RuntimeError):
    """Setting up or using the remote host failed."""


# --- delay line: pure policy, then the NFQUEUE loop around it --------------------------------


@dataclass
class DelayLine(Generic[T]):
    """Items leave exactly ``delay`` seconds after they arrive, in arrival order (a constant
    delay never reorders, so a FIFO is enough)."""

    delay: float
    _queue: collections.deque[tuple[float, T]] = field(default_factory=collections.deque)

    def push(self, item: T, now: float) -> None:
        self._queue.append((now + self.delay, item))

    def pop_due(self, now: float) -> list[T]:
        out = []
        while self._queue and self._queue[0][0] <= now:
            out.append(self._queue.popleft()[1])
        return out

    def timeout(self, now: float) -> float | None:
        """Seconds until the next item is due (0 if overdue), None when empty."""
        if not self._queue:
            return None
        return max(0.0, self._queue[0][0] - now)

    def __len__(self) -> int:
        return len(self._queue)


# Packets the kernel may hold for the handler; beyond it, it drops (TCP recovers, slowly).
QUEUE_MAXLEN = 65536


def run_delay(queue_num: int, delay_ms: float, ready: IO[str] | None = None) -> int:
    """Hold every packet of NFQUEUE ``queue_num`` for ``delay_ms``, then accept it. Runs in
    the namespace whose queue it serves, until SIGTERM/SIGINT; returns packets handled."""
    from netfilterqueue import COPY_META, NetfilterQueue

    line: DelayLine = DelayLine(delay_ms / 1000.0)
    handled = 0

    def on_packet(pkt) -> None:  # noqa: ANN001
        line.push(pkt, time.monotonic())

    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    nfq = NetfilterQueue()
    nfq.bind(queue_num, on_packet, max_len=QUEUE_MAXLEN, mode=COPY_META)
    fd = nfq.get_fd()
    if ready is not None:
        ready.write("bound\n")
        ready.flush()
    try:
        while not stop:
            timeout = line.timeout(time.monotonic())
            try:
                readable, _, _ = select.select([fd], [], [], 0.2 if timeout is None else timeout)
            except InterruptedError:
                continue
            if readable:
                nfq.run(block=False)
            for pkt in line.pop_due(time.monotonic()):
                pkt.accept()
                handled += 1
    finally:
        for pkt in line.pop_due(float("inf")):
            pkt.accept()
        nfq.unbind()
    return handled


# --- registry access log --------------------------------------------------------------------

# Combined log format: host - user [date] "METHOD PATH PROTO" status size "referer" "agent"
_ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) [^"]*" (?P<status>\d{3}) (?P<size>\d+|-)')


@dataclass(frozen=True)
class AccessSummary:
    requests: int = 0
    body_bytes: int = 0
    blob_gets: int = 0
    range_gets: int = 0  # 206 Partial Content answers


def parse_access_log(text: str) -> AccessSummary:
    """Requests and response body bytes in a slice of the registry's access log."""
    requests = body = blobs = ranges = 0
    for m in _ACCESS.finditer(text):
        requests += 1
        if m["size"] != "-":
            body += int(m["size"])
        if m["method"] == "GET" and "/blobs/" in m["path"]:
            blobs += 1
            if m["status"] == "206":
                ranges += 1
    return AccessSummary(requests, body, blobs, ranges)


# --- the remote host -------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """What crossed the link from the remote host during a measurement."""

    wire_bytes: int  # host veth rx_bytes: IP packets incl. headers
    body_bytes: int  # registry response bodies, from its access log
    requests: int
    range_gets: int


class RemoteHost:
    """The namespace, its link, its shaping, and the processes in it.

    with RemoteHost(NetConfig(), workdir) as remote:
        registry = remote.start_registry(data_dir)     # "10.213.77.2:5000"
        remote.shape(PRESETS["1g-1ms"])
        mark = remote.traffic_mark()
        ...                                            # pull
        traffic = remote.traffic_since(mark)
    """

    REGISTRY_PORT = 5000

    def __init__(self, cfg: NetConfig, workdir: Path) -> None:
        self.cfg = cfg
        self.workdir = Path(workdir)
        self.preset: Preset = PRESETS["none"]
        self._registry: subprocess.Popen | None = None
        self._registry_log: Path | None = None
        self._delay: subprocess.Popen | None = None

    # lifecycle

    def __enter__(self) -> RemoteHost:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def up(self) -> None:
        teardown(self.cfg)  # whatever a crashed run left behind
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            run_commands(setup_commands(self.cfg))
        except Exception:
            teardown(self.cfg)
            raise
        log.info("remote host %s up at %s", self.cfg.namespace, self.cfg.remote_addr)

    def close(self) -> None:
        self._stop(self._delay)
        self._delay = None
        self._stop(self._registry)
        self._registry = None
        teardown(self.cfg)

    @staticmethod
    def _stop(proc: subprocess.Popen | None) -> None:
        if proc is not None:
            stop_process(proc)

    # registry

    @property
    def registry_host(self) -> str:
        return f"{self.cfg.remote_addr}:{self.REGISTRY_PORT}"

    def start_registry(self, data_dir: Path) -> str:
        """Start ``docker-registry`` in the namespace, storing in ``data_dir`` (kept between
        runs, so images pushed once stay); returns ``host:port``."""
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "registry.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: false\n"
            f"storage:\n  filesystem:\n    rootdirectory: {data_dir}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.registry_host}\n"
        )
        self._registry_log = self.workdir / "registry.log"
        with open(self._registry_log, "ab") as logf:
            self._registry = subprocess.Popen(
                _in_ns(self.cfg, "docker-registry", "serve", str(config)),
                stdout=logf,
                stderr=logf,
                start_new_session=True,
            )
        self._wait_registry()
        return self.registry_host

    @property
    def registry_pid(self) -> int:
        """The registry's process (``ip netns exec`` execs it: the same pid)."""
        if self._registry is None:
            raise NetError("no registry started")
        return self._registry.pid

    def _wait_registry(self, timeout: float = 20.0) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._registry is not None and self._registry.poll() is not None:
                raise NetError(f"registry exited; see {self._registry_log}")
            with socket.socket() as s:
                s.settimeout(1.0)
                if s.connect_ex((self.cfg.remote_addr, self.REGISTRY_PORT)) == 0:
                    return
            time.sleep(0.05)
        raise NetError(f"registry not listening on {self.registry_host}")

    # shaping

    def shape(self, preset: Preset) -> None:
        """Apply ``preset`` (replacing the previous one)."""
        self._stop(self._delay)
        self._delay = None
        run_commands(shaping_commands(self.cfg, preset))
        if preset.rtt_ms > 0:
            self._delay = subprocess.Popen(
                _in_ns(self.cfg, sys.executable, str(Path(__file__).resolve()), "delay",
                       "--queue", str(self.cfg.queue_num), "--delay-ms", str(preset.rtt_ms)),
                stdout=subprocess.PIPE, text=True, start_new_session=True,
            )  # fmt: skip
            assert self._delay.stdout is not None
            ready, _, _ = select.select([self._delay.stdout], [], [], 15)
            if not ready or self._delay.stdout.readline().strip() != "bound":
                self._stop(self._delay)
                raise NetError("the NFQUEUE delay handler did not start")
        self.preset = preset
        log.info("link shaped: %s", preset)

    def check(self) -> None:
        """Raise if a helper process died (a measurement without them would be wrong)."""
        if self._registry is not None and self._registry.poll() is not None:
            raise NetError(f"registry exited with {self._registry.returncode}")
        if self._delay is not None and self._delay.poll() is not None:
            raise NetError(f"delay handler exited with {self._delay.returncode}")

    # accounting

    def _rx_bytes(self) -> int:
        return int(Path(f"/sys/class/net/{self.cfg.host_if}/statistics/rx_bytes").read_text())

    def traffic_mark(self) -> tuple[int, int]:
        size = self._registry_log.stat().st_size if self._registry_log else 0
        return self._rx_bytes(), size

    def traffic_since(self, mark: tuple[int, int]) -> Traffic:
        rx0, log0 = mark
        text = ""
        if self._registry_log is not None:
            with open(self._registry_log, "rb") as f:
                f.seek(log0)
                text = f.read().decode(errors="replace")
        s = parse_access_log(text)
        return Traffic(self._rx_bytes() - rx0, s.body_bytes, s.requests, s.range_gets)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s; waits for it either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _ns_pids(namespace: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def teardown(cfg: NetConfig) -> None:
    """Remove the namespace, its link and any process still inside it. Idempotent."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _ns_pids(cfg.namespace)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while pids and _ns_pids(cfg.namespace) and time.monotonic() < deadline:
            time.sleep(0.05)
    run_commands(
        [
            ["-", "ip", "netns", "del", cfg.namespace],
            ["-", "ip", "link", "del", cfg.host_if],
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("delay", help="run the NFQUEUE delay handler (inside the namespace)")
    d.add_argument("--queue", type=int, required=True)
    d.add_argument("--delay-ms", type=float, required=True)
    sub.add_parser("teardown", help="remove the default remote host and what is left in it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "delay":
        n = run_delay(args.queue, args.delay_ms, ready=sys.stdout)
        log.info("delay handler: %d packets delayed by %.1f ms", n, args.delay_ms)
    else:
        teardown(NetConfig())
    return 0


if __name__ == "__main__":
    sys.exit(main())
