"""Run the real stock mlx_lm.server in a subprocess, for tests and benchmarks.

Each tested mlx-lm release has its own venv (built by scripts/setup-envs);
the shim reaches the server only through PYTHONPATH, as it would for a user.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import requests

from harness.procs import chat, kill_group
from harness import ROOT, SHIM_DIR

VERSIONS = ("0.31.3", "0.32.2")
ENVS_DIR = Path(os.environ.get("MLX_WATCHDOG_ENVS", ROOT / ".venvs"))


class MissingEnvironment(RuntimeError):
    pass


def python_for(version: str) -> Path:
    """The interpreter of the venv with stock mlx-lm==version."""
    python = ENVS_DIR / f"mlx-lm-{version}" / "bin" / "python"
    if not python.exists():
        raise MissingEnvironment(
            f"{python} is missing: run scripts/setup-envs (it builds one venv per "
            f"tested mlx-lm release: {', '.join(VERSIONS)})"
        )
    return python


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_scratch: Optional[Path] = None


def scratch_report_dir() -> Path:
    """A private report folder for processes the harness starts without one.

    One per harness process, removed at its exit: a test never writes crash
    reports or fatal-stack files into the user's real report folder.
    """
    global _scratch
    if _scratch is None:
        _scratch = Path(tempfile.mkdtemp(prefix="mlx-watchdog-test-reports-"))
        atexit.register(shutil.rmtree, _scratch, True)
    return _scratch


def base_env(*, shim: bool = True, extra: Optional[Mapping[str, str]] = None) -> dict:
    """The environment of a process the harness starts: no inherited shim
    settings, offline, and its own report folder unless extra names one."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MLX_HOTFIX", "PYTHONPATH", "NOTIFY_SOCKET", "WATCHDOG_"))
    }
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if shim:
        env["PYTHONPATH"] = str(SHIM_DIR)
    env.update(extra or {})
    env.setdefault("MLX_HOTFIX_REPORT_DIR", str(scratch_report_dir()))
    return env


class StockServer:
    """One stock mlx_lm.server process on 127.0.0.1."""

    def __init__(
        self,
        version: str,
        model: Path | str,
        log_dir: Path,
        *,
        shim: bool = True,
        env: Optional[Mapping[str, str]] = None,
        args: Sequence[str] = (),
        launch: str = "python -m mlx_lm server",
        port: Optional[int] = None,
    ):
        self.version = version
        self.python = python_for(version)
        self.model = str(model)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Its own report folder and heartbeat file unless the test names them.
        own = {"MLX_HOTFIX_REPORT_DIR": str(Path(log_dir) / f"reports-{self.port}"),
               "MLX_HOTFIX_HEARTBEAT_FILE": str(Path(log_dir) / f"heartbeat-{self.port}.json")}
        self.env = base_env(shim=shim, extra={**own, **(env or {})})
        self.report_dir = Path(self.env["MLX_HOTFIX_REPORT_DIR"])
        self.heartbeat_file = self.env["MLX_HOTFIX_HEARTBEAT_FILE"] or None
        self.args = list(args)
        self.launch = launch
        self.log_path = Path(log_dir) / f"server-{self.port}.log"
        self.proc: Optional[subprocess.Popen] = None

    def command(self) -> list:
        server_args = ["--model", self.model, "--host", "127.0.0.1", "--port", str(self.port)]
        server_args += self.args
        py = str(self.python)
        if self.launch == "python -m mlx_lm server":
            return [py, "-m", "mlx_lm", "server", *server_args]
        if self.launch == "python -m mlx_lm.server":
            return [py, "-m", "mlx_lm.server", *server_args]
        if self.launch == "mlx_lm.server":
            return [str(self.python.parent / "mlx_lm.server"), *server_args]
        if self.launch == "script":
            code = "import sys, mlx_lm.server as s; sys.argv[0] = 'server'; s.main()"
            return [py, "-c", code, *server_args]
        raise ValueError(self.launch)

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> "StockServer":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.command(),
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    def wait_listening(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"server exited with {self.proc.returncode} before listening:\n{self.log()}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"server did not listen within {timeout}s:\n{self.log()}")

    def wait_exit(self, timeout: float = 60.0) -> Optional[int]:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> "StockServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def hotfix_lines(self) -> list:
        return [l for l in self.log().splitlines() if l.startswith("mlx-hotfix:")]

    # -- requests --------------------------------------------------------------
    def chat(self, content: str = "hello", *, max_tokens: int = 8, timeout: float = 60,
             stream: bool = False, **extra) -> requests.Response:
        return chat(self.url, content, max_tokens=max_tokens, timeout=timeout, stream=stream,
                    **extra)

    def health(self, timeout: float = 5) -> Optional[int]:
        try:
            return requests.get(f"{self.url}/health", timeout=timeout).status_code
        except requests.RequestException:
            return None

    def warm_up(self, timeout: float = 120, **extra) -> dict:
        """One short completion, so the model is loaded before the test starts."""
        self.wait_listening(timeout)
        response = self.chat("warm up", max_tokens=1, timeout=timeout, **extra)
        assert response.status_code == 200, (response.status_code, response.text, self.log())
        return response.json()


class BackgroundRequest:
    """A request on its own thread; records the outcome and when it came.

    `clock` times it: monotonic for tests, wall-clock where the times are
    compared with timestamps other processes wrote (bench/).
    """

    def __init__(self, send, *, name: str = "request", clock=time.monotonic):
        self.name = name
        self.response = None
        self.error: Optional[BaseException] = None
        self.body: Optional[bytes] = None
        self._clock = clock
        self.sent_at = clock()
        self.finished_at: Optional[float] = None
        self._thread = threading.Thread(target=self._run, args=(send,), daemon=True)
        self._thread.start()

    def _run(self, send) -> None:
        try:
            self.response = send()
            self.body = self.response.content  # reads a stream to its end too
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            self.error = exc
        finally:
            self.finished_at = self._clock()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def status(self) -> Optional[int]:
        return None if self.response is None else self.response.status_code

    def json(self):
        return json.loads(self.body) if self.body else None

    def __repr__(self) -> str:
        return (f"<{self.name} status={self.status} error={self.error!r} "
                f"body={(self.body or b'')[:300]!r}>")


def sse_events(body: bytes) -> list:
    """The data: payloads of an SSE body, parsed when JSON."""
    events = []
    for block in body.decode(errors="replace").split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                try:
                    events.append(json.loads(payload))
                except ValueError:
                    events.append(payload)
    return events


def run_python(version: str, code: str, *, shim: bool = True,
               env: Optional[Mapping[str, str]] = None, timeout: float = 300,
               args: Iterable[str] = (), cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Run code in the venv of an mlx-lm release, with or without the shim.

    With cwd=ROOT, ``python -c`` finds ``harness`` (the current folder comes
    first on its path), as ``python -m`` from the root does.
    """
    return subprocess.run(
        [str(python_for(version)), "-c", code, *args],
        cwd=cwd,
        env=base_env(shim=shim, extra=env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_probe(version: str, module: str, *args: str, patched: bool,
              timeout: float = 600) -> dict:
    """Run harness.<module> as a script in the venv of an mlx-lm release,
    with the shim on (patched) or inert; its last stdout line, as JSON."""
    code = ("import runpy, sys; sys.argv = sys.argv[1:]; "
            f"runpy.run_module('harness.{module}', run_name='__main__')")
    result = run_python(version, code, args=[module, *args], cwd=ROOT, timeout=timeout,
                        env={"MLX_HOTFIX": "1" if patched else "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
