"""Helpers for serving tests: real aiohttp servers on loopback, in-process or as processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp
from aiohttp import web
from support import free_port, wait_port


class AppServer:
    """An aiohttp application served on 127.0.0.1 from the running event loop."""

    def __init__(self, app: web.Application, port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runner: web.AppRunner | None = None

    async def start(self) -> AppServer:
        self.runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


class BackendProcess:
    """serving.fakebackend in its own process (so it can really die)."""

    def __init__(self, *args: str, name: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name or f"b{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "serving.fakebackend",
            "--port",
            str(self.port),
            "--name",
            self.name,
            *args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait(self) -> BackendProcess:
        wait_port(self.port, timeout=30)
        return self

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def run(coro, timeout: float = 60.0):
    """Run a test coroutine with a hard time bound."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def post(
    session: aiohttp.ClientSession, url: str, *, chat: bool = False, stream: bool = False
):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    payload = {"model": "m", "prompt": "fix: i has a apple", "max_tokens": 50, "stream": stream}
    async with session.post(url + path, json=payload) as resp:
        return resp.status, resp.headers.get("x-backend"), await resp.read()
