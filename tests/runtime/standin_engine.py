"""A real OpenAI-style HTTP server standing in for vLLM in launcher tests (stdlib only).

/health: 200 once started; /v1/completions: waits the request's ``delay`` seconds (default
``--delay``), then answers with a completion; ``--fail-completions`` answers 500 instead.
Writes its pid to ``--pid-file`` so tests can check the launcher stopped it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--startup-delay", type=float, default=0.0)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--fail-completions", action="store_true")
    ap.add_argument("--pid-file")
    args = ap.parse_args()
    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(str(os.getpid()))
    time.sleep(args.startup_delay)
    served = {"completions": 0, "in_flight": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a) -> None:
            pass

        def _json(self, status: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {})
            elif self.path == "/stats":
                self._json(200, served)
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:
            n = int(self.headers.get("content-length", 0))
            req = json.loads(self.rfile.read(n) or b"{}")
            if self.path != "/v1/completions":
                self._json(404, {"error": "not found"})
                return
            if args.fail_completions:
                self._json(500, {"error": "broken"})
                return
            served["in_flight"] += 1
            time.sleep(float(req.get("delay", args.delay)))
            served["in_flight"] -= 1
            served["completions"] += 1
            self._json(
                200,
                {
                    "object": "text_completion",
                    "model": req.get("model"),
                    "choices": [{"index": 0, "text": " corrected.", "finish_reason": "stop"}],
                },
            )

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.serve_forever()


if __name__ == "__main__":
    main()
