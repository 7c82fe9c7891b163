"""Run the real `mlx-watchdog` CLI (supervise, watch) as a process, for tests.

`WatchdogProcess` starts `<this python> -m mlx_watchdog <args> --log-format
json --state-file <tmp>` in its own session, its output (the watchdog's JSON
log lines, and a supervised child's own output, which shares it) in a file.
It reads the events and the state file, waits for them with bounded waits,
and cleans up every process group it started: its own, and every child the
log says was spawned (each leads its own group). Groups are killed by their
id, never by name, and only while psutil says the process is still the one
we started (not a reused pid).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import psutil
import requests

from harness.procs import chat, kill_group
from harness.server import scratch_report_dir

_PID = re.compile(r"started pid (\d+)")


class WaitTimeout(AssertionError):
    pass


class WatchdogProcess:
    def __init__(
        self,
        tmp_path: Path,
        args: Sequence[str],
        *,
        name: str = "watchdog",
        env: Optional[Mapping[str, str]] = None,
        log_format: bool = True,
        state_file: bool = True,
    ):
        self.name = name
        self.log_path = Path(tmp_path) / f"{name}.log"
        self.state_path = Path(tmp_path) / f"{name}-state.json"
        command, rest = list(args[:1]), list(args[1:])
        if log_format:
            command += ["--log-format", "json"]
        if state_file:
            command += ["--state-file", str(self.state_path)]
        self.argv = [sys.executable, "-m", "mlx_watchdog", *command, *rest]
        self._children: Dict[int, psutil.Process] = {}
        environment = dict(os.environ if env is None else env)
        # The watchdog and the servers it starts report into the test's folder,
        # never the user's, unless the test names one.
        # (base_env's folder is one per pytest process, shared by its tests: not that.)
        if environment.get("MLX_HOTFIX_REPORT_DIR") in (None, "", str(scratch_report_dir())):
            environment["MLX_HOTFIX_REPORT_DIR"] = str(Path(tmp_path) / f"{name}-reports")
        self.report_dir = Path(environment["MLX_HOTFIX_REPORT_DIR"])
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._me = psutil.Process(self.proc.pid)

    # -- reading ------------------------------------------------------------------

    def text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def events(self) -> List[dict]:
        """The watchdog's JSON log lines, in order (the child's own output skipped)."""
        found = []
        for line in self.text().splitlines():
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and "event" in event:
                    found.append(event)
        self._note_children(found)
        return found

    def child_pids(self) -> List[int]:
        """Every child pid the supervisor reported starting, in order."""
        self.events()
        return list(self._children)

    def current_child(self) -> Optional[int]:
        pids = self.child_pids()
        return pids[-1] if pids else None

    def _note_children(self, events: List[dict]) -> None:
        for event in events:
            if event.get("event") not in ("spawned", "restarted"):
                continue
            pid = event.get("pid")
            if not isinstance(pid, int):
                match = _PID.search(event.get("message", ""))
                pid = int(match.group(1)) if match else None
            if pid and pid not in self._children:
                try:
                    self._children[pid] = psutil.Process(pid)
                except psutil.NoSuchProcess:
                    self._children[pid] = None

    def state(self) -> dict:
        """The state file's instances ({} until it is written)."""
        try:
            return json.loads(self.state_path.read_text())["instances"]
        except (FileNotFoundError, ValueError, KeyError):
            return {}

    def record(self, instance: Optional[str] = None) -> dict:
        instances = self.state()
        if instance is None:
            return next(iter(instances.values()), {})
        return instances.get(instance, {})

    def alive(self) -> bool:
        return self.proc.poll() is None

    # -- waiting --------------------------------------------------------------------

    def wait_for(self, condition: Callable[[], object], timeout: float, what: str,
                 interval: float = 0.1):
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"timed out after {timeout:g}s waiting for {what}\n"
                                  + self.tail())
            time.sleep(interval)

    def wait_event(self, predicate: Callable[[dict], bool], timeout: float, what: str,
                   after: int = 0) -> dict:
        """The first event (from index `after`) matching predicate."""

        def find():
            for event in self.events()[after:]:
                if predicate(event):
                    return event
            return None

        return self.wait_for(find, timeout, what)

    def tail(self, chars: int = 6000) -> str:
        return f"--- {self.name} log (tail) ---\n{self.text()[-chars:]}"

    # -- stopping -------------------------------------------------------------------

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM the watchdog (it passes the signal on to its child); its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def cleanup(self) -> None:
        """SIGKILL whatever is left: the watchdog's group and every child's group."""
        kill_group(self.proc)
        self.events()
        for proc in self._children.values():
            if proc is not None:
                _kill_child_group(proc)


def _kill_child_group(proc: psutil.Process) -> None:
    # Not our child: psutil checks the pid still names the same process.
    try:
        if proc.is_running():  # also checks the pid was not reused
            if proc.status() == psutil.STATUS_ZOMBIE:
                return
            kill_group(proc.pid)
    except psutil.Error:
        pass


def is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- clients --------------------------------------------------------------------------


def wait_serving(url: str, timeout: float, *, what: str = "a 200 completion",
                 log: Optional[WatchdogProcess] = None, **extra) -> requests.Response:
    """Poll one-token completions until one is answered 200 with a token."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            response = chat(url, "are you there", max_tokens=1, timeout=(1, 30), **extra)
            if response.status_code == 200 and response.json().get("choices"):
                return response
            last = f"HTTP {response.status_code}: {response.text[:200]}"
        except (requests.RequestException, ValueError) as exc:
            last = f"{type(exc).__name__}"
        time.sleep(0.2)
    raise WaitTimeout(f"no {what} within {timeout:g}s (last: {last})\n"
                      + (log.tail() if log else ""))
