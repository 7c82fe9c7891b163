"""A tiny stand-in for mlx_lm.server, for the watchdog's own tests.

In process: `FakeServer(completion=..., health=...)` on a free 127.0.0.1
port, each answer chosen by the test (see the BEHAVIOURS below).

As a script (the child of a real `mlx-watchdog supervise` in tests):
    python harness/fakeserver.py --port N --starts FILE [--first-start ok|hang|exit]
appends its pid to FILE on start; on the first start only, it misbehaves
after one good completion ("hang": completions never answer; "exit": the
process exits with code 70, like the hotfix shim). Later starts are healthy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional, Tuple

GOOD_COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "default_model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "po"},
                 "finish_reason": "length"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}


def json_answer(status: int, body: object) -> Tuple[int, bytes]:
    return status, json.dumps(body).encode()


OK = json_answer(200, GOOD_COMPLETION)
HEALTH_OK = json_answer(200, {"status": "ok"})
HEALTH_DEAD = json_answer(503, {"status": "unavailable"})
DEAD_THREAD = json_answer(404, {"error": "generation thread died"})
# Special behaviours, instead of a (status, body) answer:
HANG = "hang"  # never answer
DRIBBLE_BODY = "dribble-body"  # headers, then one body byte every 50 ms, forever
DRIBBLE_HEADERS = "dribble-headers"  # one header byte every 50 ms, forever
DROP = "drop"  # close the connection without a word


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._answer(self.server.fake.health if self.path == "/health" else (404, b"Not Found"))

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"null")
        fake = self.server.fake
        fake.requests.append((self.path, dict(self.headers), body))
        answer = fake.completion
        self._answer(answer(body) if callable(answer) else answer)

    def _answer(self, answer) -> None:
        stop = self.server.fake.stopping
        if answer == HANG:
            stop.wait()
            return
        if answer == DROP:
            self.close_connection = True
            return
        if answer == DRIBBLE_HEADERS:
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100000:
                if stop.wait(0.05):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            return
        if answer == DRIBBLE_BODY:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100000")
            self.end_headers()
            while not stop.wait(0.05):
                self.wfile.write(b" ")
                self.wfile.flush()
            return
        status, payload = answer
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: "FakeServer"

    def handle_error(self, request, client_address) -> None:
        # A client that hangs up (HAProxy closes its checks with a reset) is not news.
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


class FakeServer:
    def __init__(self, completion=OK, health=HEALTH_OK, port: int = 0):
        self.completion = completion  # (status, body), a behaviour, or body -> answer
        self.health = health
        self.requests: List[Tuple[str, dict, object]] = []
        self.stopping = threading.Event()
        self._server = _Server(("127.0.0.1", port), _Handler)
        self._server.fake = self
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()


def _main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--starts", required=True)
    parser.add_argument("--first-start", choices=("ok", "hang", "exit"), default="ok")
    args = parser.parse_args(argv)
    with open(args.starts, "a+") as handle:
        handle.seek(0)
        first = not handle.read().strip()
        handle.write(f"{os.getpid()}\n")
    mode = args.first_start if first else "ok"
    served = []

    def completion(body: object):
        served.append(body)
        if len(served) <= 1 or mode == "ok":
            return OK
        if mode == "exit":
            threading.Timer(0.05, os._exit, args=(70,)).start()
            return DROP
        return HANG

    fake = FakeServer(completion=completion, port=args.port)
    with fake:
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    sys.exit(_main())
