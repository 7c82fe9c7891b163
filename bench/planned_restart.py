"""What clients see of a restart: requests failed and connections refused
during a planned restart and during a death, with the drain and the held
listening socket against today's behaviour, in one run (issue 20).

A real stock mlx_lm.server 0.32.2 with the shim, tiny llama, under
`mlx-watchdog supervise --probe-interval 1` in two arms, one after the other:

  drain + held socket  supervise's default: it holds the port, the shim drains
                       on SIGTERM (MLX_HOTFIX_DRAIN_TIMEOUT 25 s).
  today                `supervise --no-socket` and MLX_HOTFIX_DRAIN_TIMEOUT=0:
                       each child binds the port itself, and a SIGTERM answers
                       every waiting client 503 at once (the behaviour before).

Three clients send one completion after another the whole time (two plain,
one streamed; 30 tokens each; each waits up to 180 s for an answer). In
each arm: N planned restarts (`mlx-watchdog restart NAME`, which waits until
the server serves again), then N deaths (a one-shot injected fault, the
generation thread dies at its next decode step; supervise restarts the
child). For each event, the requests sent from just before it until every
client has had two answers from the new server: how many failed (not a
200, or a stream cut without [DONE]), how many were refused (nothing
listening), and the longest answer time among them.

    .venvs/mlx-lm-0.32.2/bin/python -m bench.planned_restart [--quick] [--events N]
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from bench.common import CLEANUP, FAULTS_DIR, Figure, build_model, fmt, table, temp_dir
from harness.haproxy import ClientLoop, Outcome, StreamedAnswer
from harness.procs import chat
from harness.server import base_env, free_port, python_for
from harness.watchdog_run import WatchdogProcess, wait_serving

VERSION = "0.32.2"
LOAD_S = 180.0
FAULT = "raise:typeerror:decode"
ARMS = {
    "drain + held socket": {"flags": [], "env": {}},
    "today": {"flags": ["--no-socket"], "env": {"MLX_HOTFIX_DRAIN_TIMEOUT": "0"}},
}


def _add_arguments(parser):
    parser.add_argument("--events", type=int, default=None,
                        help="planned restarts and deaths per arm [default: 5; --quick: 2]")


class Clients:
    """Two plain clients and one streaming, each one request after another."""

    WORKERS = (2, 1)

    def __init__(self, url: str):
        self.loops = [
            ClientLoop(url, workers=2, timeout=LOAD_S, send=lambda: chat(
                url, "tell me a story", max_tokens=30, timeout=LOAD_S)),
            ClientLoop(url, workers=1, timeout=LOAD_S,
                       send=lambda: StreamedAnswer(url, timeout=LOAD_S)),
        ]
        CLEANUP.add(self)

    def marks(self) -> List[int]:
        return [len(loop.outcomes) for loop in self.loops]

    def since(self, marks: List[int]) -> List[Outcome]:
        return [o for loop, mark in zip(self.loops, marks) for o in list(loop.outcomes)[mark:]]

    def wait_answers(self, marks: List[int], each: int = 2) -> None:
        """Until every client has `each` successes after marks."""
        deadline = time.monotonic() + LOAD_S
        for loop, mark, workers in zip(self.loops, marks, self.WORKERS):
            while len([o for o in list(loop.outcomes)[mark:] if o.ok]) < each * workers:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no answers after the event: {list(loop.outcomes)[-5:]}")
                time.sleep(0.1)

    def stop(self) -> None:
        for loop in self.loops:
            loop.stop(timeout=LOAD_S)


def _supervise(tmp: Path, model: Path, name: str, arm: dict, arm_file: Path) -> tuple:
    port = free_port()
    env = base_env(shim=False, extra={
        "PYTHONPATH": str(FAULTS_DIR), "MLX_TEST_FAULT": FAULT,
        "MLX_TEST_FAULT_ARM_FILE": str(arm_file), "MLX_TEST_FAULT_ONESHOT": "1",
        "MLX_HOTFIX_REPORT_DIR": str(tmp / f"{name}-reports"), **arm["env"]})
    server = [str(python_for(VERSION)), "-m", "mlx_lm", "server", "--model", str(model),
              "--host", "127.0.0.1", "--port", str(port)]
    sup = WatchdogProcess(tmp, ["supervise", "--name", name, "--probe-interval", "1",
                                "--probe-timeout", "30", *arm["flags"], "--", *server],
                          name=name, env=env)
    CLEANUP.add(sup.proc)
    url = f"http://127.0.0.1:{port}"
    wait_serving(url, LOAD_S, log=sup)
    return sup, url


def _event(clients: Clients, trigger) -> Dict[str, object]:
    marks = clients.marks()
    trigger()
    clients.wait_answers(marks)
    seen = clients.since(marks)
    return {
        "sent": len(seen),
        "failed": len([o for o in seen if not o.ok and not o.refused]),
        "refused": len([o for o in seen if o.refused]),
        "longest_s": max((o.finished_at - o.sent_at for o in seen), default=None),
    }


def run_arm(fig: Figure, tmp: Path, model: Path, label: str, events: int) -> Dict[str, list]:
    name = "drained" if label.startswith("drain") else "today"
    arm_file = tmp / f"{name}.arm"
    sup, url = _supervise(tmp, model, name, ARMS[label], arm_file)
    clients = Clients(url)
    try:
        clients.wait_answers(clients.marks(), 1)
        results: Dict[str, list] = {"planned": [], "death": []}
        for i in range(events):
            def restart():
                done = subprocess.run(
                    [sys.executable, "-m", "mlx_watchdog", "restart", name, "--state-file",
                     str(sup.state_path), "--timeout", str(LOAD_S)],
                    capture_output=True, text=True, timeout=LOAD_S + 30)
                if done.returncode != 0:
                    raise RuntimeError(done.stdout + done.stderr + sup.tail())
            results["planned"].append(_event(clients, restart))
            fig.log(f"{label}: planned restart {i + 1}: {results['planned'][-1]}")
        for i in range(events):
            restarts = len([e for e in sup.events() if e["event"] == "restart"])

            def die(restarts=restarts):
                arm_file.touch()
                sup.wait_for(lambda: len([e for e in sup.events()
                                          if e["event"] == "restart"]) > restarts,
                             LOAD_S, "the restart after the death")
            results["death"].append(_event(clients, die))
            fig.log(f"{label}: death {i + 1}: {results['death'][-1]}")
        return results
    finally:
        clients.stop()
        CLEANUP.discard(clients)
        sup.cleanup()


def _total(events: List[dict], key: str) -> int:
    return sum(int(e[key]) for e in events)


def _longest(events: List[dict]) -> Optional[float]:
    values = [e["longest_s"] for e in events if e["longest_s"] is not None]
    return max(values) if values else None


def main() -> int:
    fig = Figure("planned_restart", "Restarts: requests lost to a planned restart and to a "
                 "death, drain and held socket against today", __doc__,
                 add_arguments=_add_arguments)
    events = fig.args.events or (2 if fig.quick else 5)
    tmp = temp_dir("bench-planned-restart-")
    model = build_model("llama", tmp / "model")
    results = {}
    for label in ARMS:
        results[label] = run_arm(fig, tmp, model, label, events)
    rows, summary = [], {}
    for kind, what in (("planned", "planned restart"), ("death", "death")):
        for label in ARMS:
            found = results[label][kind]
            key = f"{kind} / {label}"
            summary[key] = {"events": len(found), "sent": _total(found, "sent"),
                            "failed": _total(found, "failed"),
                            "refused": _total(found, "refused"),
                            "longest_s": _longest(found)}
            rows.append([what, label, len(found), summary[key]["sent"], summary[key]["failed"],
                         summary[key]["refused"], fmt(summary[key]["longest_s"], " s", 1)])
    held = summary["planned / drain + held socket"]
    summary["goal_planned_nothing_lost"] = held["failed"] == 0 and held["refused"] == 0
    summary["goal_death_nothing_refused"] = summary["death / drain + held socket"]["refused"] == 0
    body = table(["event", "arm", "events", "requests sent", "failed", "refused",
                  "longest answer"], rows)
    body += (
        "\n\nThree clients (two plain, one streamed, 30 tokens each) send one request "
        "after another through every event; counted are the requests sent from just before "
        "the event until each client has had two answers from the new server. *failed*: "
        "not a 200, or a stream cut without `[DONE]`; *refused*: nothing listened. A client "
        "whose request failed tries the next one 50 ms later, so *today*'s counts grow with "
        "the length of its outage. *longest answer*: with the held socket, a request that "
        "arrived during the restart waits for the new server's model load. "
        "*drain + held socket*: `supervise` holds the port and the shim drains on SIGTERM; "
        "*today*: `supervise --no-socket` and `MLX_HOTFIX_DRAIN_TIMEOUT=0` (a SIGTERM "
        "answers 503 at once, each child binds the port itself). A planned restart is "
        "`mlx-watchdog restart NAME`; a death is a one-shot injected fault at a decode "
        "step (the request in flight then fails in both arms). "
        f"Goal, planned restarts with drain and held socket lose nothing: "
        f"{'met' if summary['goal_planned_nothing_lost'] else 'NOT met'}.")
    fig.write(results, body, summary)
    return 0


if __name__ == "__main__":
    from bench.common import run_main

    run_main(main)
