"""Run monitoring/haproxy.cfg in a real HAProxy in front of test servers.

The shipped file is used as is, except for its addresses: the front end and
the stats page bind to free 127.0.0.1 ports, and its `server` lines are
replaced by the test's servers (same options, from `default-server`).
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional

import pytest
import requests

from harness.procs import chat, kill_group
from harness.server import free_port

CONFIG = Path(__file__).resolve().parents[1] / "monitoring" / "haproxy.cfg"
BACKEND = "mlx_servers"


def haproxy_binary() -> str:
    path = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("haproxy is missing: .ci/run installs Debian's haproxy package")
        pytest.skip("haproxy not installed (apt-get install haproxy); CI installs it")
    return path


def config_for(servers: Mapping[str, str], port: int, stats_port: int) -> str:
    """The shipped config with the test's addresses (servers: name -> http://host:port)."""
    text = CONFIG.read_text()
    text, binds = re.subn(r"^(\s*)bind :8080$", rf"\1bind 127.0.0.1:{port}", text, flags=re.M)
    text, stats = re.subn(r"^(\s*)bind 127\.0\.0\.1:8404$", rf"\1bind 127.0.0.1:{stats_port}",
                          text, flags=re.M)
    lines = text.splitlines()
    server_lines = [i for i, line in enumerate(lines) if line.strip().startswith("server ")]
    assert binds == 1 and stats == 1 and server_lines, "monitoring/haproxy.cfg changed shape"
    indent = lines[server_lines[0]][: len(lines[server_lines[0]]) - len(lines[server_lines[0]].lstrip())]
    ours = [f"{indent}server {name} {url.split('://', 1)[1]} check" for name, url in servers.items()]
    lines[server_lines[0]: server_lines[-1] + 1] = ours
    return "\n".join(lines) + "\n"


class HAProxy:
    def __init__(self, tmp_path: Path, servers: Mapping[str, str]):
        self.port, self.stats_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = Path(tmp_path) / "haproxy.cfg"
        self.config_path.write_text(config_for(servers, self.port, self.stats_port))
        self.log_path = Path(tmp_path) / "haproxy.log"
        binary = haproxy_binary()
        check = subprocess.run([binary, "-c", "-f", str(self.config_path)],
                               capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([binary, "-db", "-f", str(self.config_path)],
                                         stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def statuses(self) -> Dict[str, str]:
        """Each server's status as HAProxy sees it: UP, DOWN, "UP 1/3" ..."""
        text = requests.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {row["svname"]: row["status"] for row in rows
                if row["pxname"] == BACKEND and row["svname"] not in ("FRONTEND", "BACKEND")}

    def wait_status(self, name: str, status: str, timeout: float = 60) -> float:
        """Wait until server `name` is exactly `status` (UP or DOWN); returns when (monotonic)."""
        deadline = time.monotonic() + timeout
        seen = None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"haproxy exited:\n{self.log()}"
            try:
                seen = self.statuses().get(name)
            except requests.RequestException:
                seen = None
            if seen == status:
                return time.monotonic()
            time.sleep(0.1)
        raise AssertionError(f"haproxy: {name} still {seen!r}, not {status}, after {timeout}s\n"
                             f"{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        kill_group(self.proc, grace_s=10, wait_s=10)


@dataclass
class Outcome:
    sent_at: float
    finished_at: float
    status: Optional[int]
    server: Optional[str]  # X-MLX-Server: which backend answered
    error: Optional[str]

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def refused(self) -> bool:
        """The connection was refused: nothing listened on the port."""
        return self.error is not None and "Connection refused" in self.error


class StreamedAnswer:
    """A streamed completion read to its end, shaped like a response for
    ClientLoop (its `send`): json() fails unless the stream ended with [DONE],
    so a stream cut short, with or without an error event, counts as failed."""

    def __init__(self, url: str, *, max_tokens: int = 30, timeout: float = 60):
        from harness.server import sse_events

        response = chat(url, "tell me a story", max_tokens=max_tokens, timeout=timeout,
                        stream=True)
        self.status_code, self.headers = response.status_code, response.headers
        self.events = sse_events(response.content) if response.status_code == 200 else []

    def json(self) -> dict:
        if not self.events or self.events[-1] != "[DONE]":
            raise ValueError(f"the stream was cut: {self.events[-2:]}")
        return {"choices": [self.events[-2]]}


class ClientLoop:
    """`workers` clients, each sending one completion after another through HAProxy."""

    def __init__(self, url: str, *, workers: int = 2, timeout: float = 60,
                 send: Optional[Callable[[], requests.Response]] = None):
        self.url = url
        self.timeout = timeout
        self.outcomes: List[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._send = send or self._chat
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]
        for thread in self._threads:
            thread.start()

    def _chat(self) -> requests.Response:
        return chat(self.url, "hi", max_tokens=3, timeout=self.timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            status = server = error = None
            try:
                response = self._send()
                status, server = response.status_code, response.headers.get("X-MLX-Server")
                if status == 200:
                    response.json()["choices"][0]
            except Exception as exc:  # noqa: BLE001 - recorded for the test
                error = repr(exc)
            with self._lock:
                self.outcomes.append(Outcome(sent, time.monotonic(), status, server, error))
            if error:
                time.sleep(0.05)

    def wait_count(self, predicate: Callable[[Outcome], bool], count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.since(predicate)) >= count:
                return
            time.sleep(0.1)
        raise AssertionError(f"fewer than {count} matching requests in {timeout}s: "
                             f"{self.outcomes[-10:]}")

    def since(self, predicate: Callable[[Outcome], bool]) -> List[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if predicate(o)]

    def stop(self, timeout: float = 2) -> None:
        """Stop sending. A request still stuck on a wedged server is left to its
        (daemon) thread: it ends when the test kills that server."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
