"""The mlx-watchdog demo: a real crash of the stock mlx_lm.server, turned into
a clean restart.

It builds a tiny random-weight llama (nothing is downloaded) and runs the real
stock mlx-lm 0.31.3 server on the CPU three times:

1. stock, no shim: two plain HTTP requests kill the generation thread
   (upstream #1505); /health stays 200 and the second request hangs.
2. under `mlx-watchdog supervise`, shim on, extend patch off: the same two
   requests; the waiting client gets a 503 at once, the server exits 70 and
   the supervisor restarts it; it serves again.
3. the same with the extend patch on: both requests succeed, no restart.

Run it with scripts/demo (which sets up the environments first).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from harness.procs import chat, kill_group
from harness.repro import EXTEND_CRASH_ARGS, send_extend_crash_pair, warm_up_with_penalty
from harness.server import StockServer, base_env, free_port, python_for
from harness.tinymodel import build_llama

VERSION = "0.31.3"
ZOMBIE_WAIT_S = 15
BOLD, DIM, RED, GREEN, RESET = (
    ("\033[1m", "\033[2m", "\033[31m", "\033[32m", "\033[0m") if sys.stdout.isatty() else ("",) * 5
)
T0 = time.monotonic()


def say(text: str = "") -> None:
    print(f"{DIM}[{time.monotonic() - T0:6.1f}s]{RESET} {text}", flush=True)


def heading(text: str) -> None:
    print(f"\n{BOLD}== {text}{RESET}", flush=True)


def outcome(request) -> str:
    if request.error is not None:
        kind = type(request.error).__name__
        return f"{RED}no answer ({kind}){RESET}"
    if request.status == 200:
        usage = request.json().get("usage", {})
        return f"{GREEN}200{RESET}, {usage.get('completion_tokens')} tokens"
    body = request.body.decode(errors="replace")[:140]
    return f"{RED}{request.status}{RESET} {body}"


def wait_until(predicate, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


def act_stock(model: Path, logs: Path) -> None:
    heading("1. Stock mlx_lm.server 0.31.3, no shim: the zombie")
    server = StockServer(VERSION, model, logs, shim=False, args=EXTEND_CRASH_ARGS).start()
    try:
        warm_up_with_penalty(server)
        say("two requests: A (long prompt), then B 50 ms later with repetition_penalty")
        a, b = send_extend_crash_pair(server, timeout=ZOMBIE_WAIT_S)
        a.join(ZOMBIE_WAIT_S + 30)
        b.join(ZOMBIE_WAIT_S + 30)
        say(f"A: {outcome(a)}")
        say(f"B: {outcome(b)} after waiting {ZOMBIE_WAIT_S}s")
        died = [l for l in server.log().splitlines() if l.startswith("TypeError")]
        say(f"server log: {died[0] if died else '(no traceback?)'}")
        say(f"process alive: {server.alive()}, GET /health -> {server.health()}  "
            f"{RED}<- a zombie: every later completion hangs forever{RESET}")
    finally:
        server.stop()


class Supervised:
    """`mlx-watchdog supervise -- <stock server>`, its output in a file."""

    def __init__(self, model: Path, logs: Path, *, disable: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = logs / f"supervise-{self.port}.log"
        server = [str(python_for(VERSION)), "-m", "mlx_lm", "server", "--model", str(model),
                  "--port", str(self.port), *EXTEND_CRASH_ARGS]
        watchdog = [sys.executable, "-m", "mlx_watchdog", "supervise", "--probe-interval", "2",
                    "--state-file", str(logs / f"state-{self.port}.json"), "--", *server]
        env = base_env(shim=False, extra={"MLX_HOTFIX_DISABLE": disable})
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(watchdog, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        say(f"$ MLX_HOTFIX_DISABLE={disable or '(none)'} mlx-watchdog supervise -- "
            f"python -m mlx_lm server --model tiny-llama --port {self.port} "
            f"{' '.join(EXTEND_CRASH_ARGS)}")

    def lines(self) -> list:
        return self.log_path.read_text(errors="replace").splitlines()

    def show(self, pattern: str, seen: set) -> None:
        for line in self.lines():
            if re.search(pattern, line) and line not in seen:
                seen.add(line)
                say(f"{DIM}log|{RESET} {line}")

    def ready(self, timeout: float = 120) -> bool:
        def answers() -> bool:
            try:
                return chat(self.url, "hi", max_tokens=1, timeout=30,
                            repetition_penalty=1.3).status_code == 200
            except requests.RequestException:
                return False
        return wait_until(answers, timeout, 0.2)

    def stop(self) -> None:
        kill_group(self.proc, grace_s=30)  # SIGTERM: the supervisor stops its child first
        self._log.close()


INTERESTING = r"mlx-hotfix:|^TypeError|\b(spawned|exited|restarted|stopped)\b"


def act_supervised_crash(model: Path, logs: Path) -> None:
    heading("2. Under mlx-watchdog supervise, shim on, extend patch OFF: a clean restart")
    supervised = Supervised(model, logs, disable="extend")
    seen: set = set()
    try:
        if not supervised.ready():
            raise SystemExit("the supervised server did not come up:\n" + "\n".join(supervised.lines()))
        supervised.show(INTERESTING, seen)

        class Handle:  # send_extend_crash_pair wants a server-like object
            chat = StockServer.chat
            url = supervised.url

        say("the same two requests")
        a, b = send_extend_crash_pair(Handle(), timeout=60)
        a.join(90)
        b.join(90)
        say(f"A: {outcome(a)}")
        say(f"B: {outcome(b)}")
        wait_until(lambda: any(re.search(r"\bexited\b", l) for l in supervised.lines()), 30)
        supervised.show(INTERESTING, seen)
        if supervised.ready():
            say(f"{GREEN}serving again{RESET}, {time.monotonic() - b.finished_at:.1f}s after B got "
                f"its answer (model reload included)")
        else:
            say(f"{RED}not serving again{RESET}")
    finally:
        supervised.stop()


def act_patched(model: Path, logs: Path) -> None:
    heading("3. The same with the extend patch ON: no crash at all")
    supervised = Supervised(model, logs, disable="")
    seen: set = set()
    try:
        if not supervised.ready():
            raise SystemExit("the supervised server did not come up")
        supervised.show(r"mlx-hotfix:", seen)

        class Handle:
            chat = StockServer.chat
            url = supervised.url

        a, b = send_extend_crash_pair(Handle(), timeout=60)
        a.join(90)
        b.join(90)
        say(f"A: {outcome(a)}")
        say(f"B: {outcome(b)}")
        restarts = sum(bool(re.search(r"\bexited\b", l)) for l in supervised.lines())
        say(f"restarts: {restarts}")
    finally:
        supervised.stop()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="mlx-watchdog-demo-") as folder:
        logs = Path(folder)
        say("building a tiny random-weight llama (2 layers, vocab 300) ...")
        model = build_llama(logs / "tiny-llama")
        act_stock(model, logs)
        act_supervised_crash(model, logs)
        act_patched(model, logs)
        print()


if __name__ == "__main__":
    main()
