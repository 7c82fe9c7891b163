"""Processes and clients with wall-clock timestamps, for the figure scripts.

TimedServer is the tests' StockServer (same command line, environment and
request helpers) whose output goes through a pipe: every line is stamped
with time.time() as it arrives, and a waiter thread stamps the moment the
process exit is observed (waitpid returns). TimedProcess is the same for any
command (the supervisor). Client is one HTTP request on its own thread that
records when it was sent and answered, and what the answer was.

Everything started here leads its own process group and is registered with
common.CLEANUP, so Ctrl-C or an exception kills it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import requests

from bench.common import CLEANUP
from harness.server import BackgroundRequest, StockServer, sse_events


class _Output:
    """Reads a pipe line by line, stamping each line, and records the exit."""

    def __init__(self, proc: subprocess.Popen, log_path: Path):
        self.proc = proc
        self.lines: List[Tuple[float, str]] = []
        self.exited_at: Optional[float] = None
        self.returncode: Optional[int] = None
        self._cond = threading.Condition()
        self._log = open(log_path, "w", buffering=1)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        self._reader.start()
        self._waiter.start()

    def _read(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            t = time.time()
            text = raw.decode(errors="replace").rstrip("\n")
            with self._cond:
                self.lines.append((t, text))
                self._cond.notify_all()
            try:
                self._log.write(text + "\n")
            except ValueError:
                pass

    def _wait(self) -> None:
        code = self.proc.wait()
        t = time.time()
        with self._cond:
            self.exited_at, self.returncode = t, code
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def find(self, pattern: "re.Pattern[str]", start: int = 0) -> Optional[Tuple[int, float, "re.Match[str]"]]:
        with self._cond:
            lines = self.lines[start:]
        for i, (t, text) in enumerate(lines, start):
            m = pattern.search(text)
            if m:
                return i, t, m
        return None

    def wait_line(self, pattern: "re.Pattern[str]", timeout: float, start: int = 0):
        """(index, arrival time, match) of the first line from start matching, or None."""
        found = []

        def check():
            hit = self.find(pattern, start)
            if hit:
                found.append(hit)
            return bool(hit) or self.exited_at is not None

        self.wait_for(check, timeout)
        if not found:  # exited: look once more, the last lines may have come in since
            hit = self.find(pattern, start)
            return hit
        return found[0]

    def wait_exit(self, timeout: float) -> Optional[int]:
        self.wait_for(lambda: self.exited_at is not None, timeout)
        return self.returncode

    def text(self) -> str:
        with self._cond:
            return "\n".join(t for _, t in self.lines)

    def close(self) -> None:
        self._waiter.join(30)
        self._reader.join(5)
        self._log.close()


def _kill_group_if_running(proc: subprocess.Popen, out: Optional[_Output], sig=signal.SIGKILL) -> None:
    # Only while not reaped: after waitpid the id may belong to someone else.
    if proc.returncode is None and (out is None or out.exited_at is None):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class TimedServer(StockServer):
    """StockServer with timestamped output lines and a timestamped exit."""

    def start(self) -> "TimedServer":
        self.proc = subprocess.Popen(
            self.command(), env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        CLEANUP.add(self)
        self.out = _Output(self.proc, self.log_path)
        return self

    def wait_exit(self, timeout: float = 60.0) -> Optional[int]:
        return self.out.wait_exit(timeout)

    @property
    def exited_at(self) -> Optional[float]:
        return self.out.exited_at

    def stop(self) -> None:
        if self.proc is None:
            return
        _kill_group_if_running(self.proc, self.out)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        self.out.close()
        CLEANUP.discard(self)

    def log(self) -> str:
        return self.out.text() if getattr(self, "out", None) else ""


class TimedProcess:
    """Any command in its own process group, output stamped like TimedServer's."""

    def __init__(self, argv: Sequence[str], env: dict, log_path: Path):
        self.argv = list(argv)
        self.proc = subprocess.Popen(self.argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.out = _Output(self.proc, log_path)
        self.extra_groups: List = []  # psutil.Process of group leaders started by it
        CLEANUP.add(self)

    def pause(self) -> None:
        """SIGSTOP the process itself (not its group)."""
        if self.out.exited_at is None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.out.exited_at is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self, term_grace: float = 15.0) -> None:
        """SIGTERM (a supervisor passes it on to its child), SIGKILL after term_grace;
        then SIGKILL every extra group still running."""
        try:
            self.resume()
        except OSError:
            pass
        _kill_group_if_running(self.proc, self.out, signal.SIGTERM)
        if self.out.wait_exit(term_grace) is None:
            _kill_group_if_running(self.proc, self.out)
            self.out.wait_exit(30)
        for leader in self.extra_groups:
            try:
                if leader.is_running():  # psutil: also checks the pid was not reused
                    os.killpg(leader.pid, signal.SIGKILL)
            except Exception:  # noqa: BLE001 - gone already
                pass
        self.out.close()
        CLEANUP.discard(self)


# -- clients -----------------------------------------------------------------------------

COMPLETED, TOLD, ERROR = "completed", "told", "error"
WAITING, RESET, TRUNCATED = "waiting", "reset", "truncated"


class Client(BackgroundRequest):
    """One request on its own thread, timed with time.time()."""

    def __init__(self, name: str, send: Callable[[], requests.Response], stream: bool = False):
        self.stream = stream
        super().__init__(send, name=name, clock=time.time)

    def outcome(self) -> str:
        """completed (a full normal answer), told (503 JSON or a final SSE error
        event naming the death), error (another HTTP error), waiting (timed out
        or still running), reset (the connection failed or broke off without an
        answer), truncated (a stream that ended with neither [DONE] nor an error
        event, or a 200 whose body is not JSON)."""
        if self.finished_at is None or isinstance(self.error, (requests.Timeout, TimeoutError)):
            return WAITING
        if self.error is not None:
            # requests reports a read timeout inside a stream as a ConnectionError.
            return WAITING if "timed out" in str(self.error) else RESET
        status = self.status
        if self.stream and status == 200:
            events = sse_events(self.body or b"")
            if events and events[-1] == "[DONE]":
                return COMPLETED
            if events and isinstance(events[-1], dict) and "error" in events[-1]:
                return TOLD
            return TRUNCATED
        try:
            data = json.loads(self.body or b"")
        except ValueError:
            return TRUNCATED if status == 200 else ERROR
        if status == 200 and data.get("choices"):
            return COMPLETED
        if status == 503 and "generation thread died" in json.dumps(data):
            return TOLD
        return ERROR

    def record(self, death_at: Optional[float] = None) -> dict:
        out = {"name": self.name, "outcome": self.outcome(), "status": self.status,
               "sent_at": self.sent_at, "finished_at": self.finished_at,
               "error": None if self.error is None else f"{self.error.__class__.__name__}: {self.error}"[:300]}
        if death_at is not None and self.finished_at is not None:
            out["after_death_s"] = self.finished_at - death_at
        return out


class SentRequest(Client):
    """A chat completion whose request is fully sent before the constructor
    returns (http.client, in the caller's thread); a thread then reads the
    answer. So the server has it in its socket before anything else happens.
    first_data_at: when the first bytes of the body arrived (streams: the
    first SSE event)."""

    def __init__(self, name: str, url: str, payload: dict, *, timeout: float):
        import http.client
        from urllib.parse import urlsplit

        self.name = name
        self.stream = bool(payload.get("stream"))
        self.response = None
        self.body: Optional[bytes] = None
        self.error: Optional[BaseException] = None
        self.finished_at: Optional[float] = None
        self.first_data_at: Optional[float] = None
        self._status: Optional[int] = None
        parts = urlsplit(url)
        self._conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        try:
            self._conn.request("POST", "/v1/chat/completions", body=json.dumps(payload),
                               headers={"Content-Type": "application/json"})
        except OSError as exc:
            self.error, self.finished_at = exc, time.time()
        self.sent_at = time.time()
        self._thread = threading.Thread(target=self._read, daemon=True)
        if self.error is None:
            self._thread.start()

    def _read(self) -> None:
        chunks = []
        try:
            response = self._conn.getresponse()
            self._status = response.status
            while True:
                chunk = response.read1(65536)
                if not chunk:
                    break
                if self.first_data_at is None:
                    self.first_data_at = time.time()
                chunks.append(chunk)
            self.body = b"".join(chunks)
        except BaseException as exc:  # noqa: BLE001 - recorded
            self.error = exc
            self.body = b"".join(chunks)
        finally:
            self.finished_at = time.time()
            self._conn.close()

    def join(self, timeout: float) -> bool:
        if not self._thread.is_alive() and self.finished_at is not None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait_first_data(self, timeout: float) -> bool:
        deadline = time.time() + timeout
        while self.first_data_at is None and self.finished_at is None and time.time() < deadline:
            time.sleep(0.002)
        return self.first_data_at is not None

    @property
    def status(self) -> Optional[int]:
        return self._status
