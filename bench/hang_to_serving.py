"""Figure 2: a generation loop that hangs while alive, to serving again.

The hang: a real stock mlx_lm.server 0.32.2 (tiny random llama, CPU) whose
generation loop blocks forever inside a decode step at 0% CPU
(harness/faults: MLX_TEST_FAULT=hang:decode, armed after the warm-up,
struck by one ordinary request). /health still says 200; the process lives.

Two ways to watch it, each over several hangs:

  ours    `mlx-watchdog supervise -- <server>` with DEFAULT settings (probe
          every 5 s, 10 s timeout, 3 failures, 10 s heartbeat timeout, 60 s
          boot grace). Only `--log-format json --state-file <tmp>` are added,
          to read its events and keep its state out of the user's home. The
          shim's heartbeat stops with the loop: one failed probe after it is
          10 s old is a restart.
  naive   a prober with a fixed threshold in the Kubernetes liveness-probe
          default style, implemented here: every 10 s one probe (the same
          one-token completion, mlx_watchdog.probe.Probe) with a 1 s
          timeout; 3 failures in a row: SIGTERM the server's group (SIGKILL
          after 30 s) and start it again.

Each hang starts at a random moment of the watcher's probe cycle. Ours
gets a fresh supervisor every 5 hangs: by default more than 5 restarts in
300 s is a crash loop and restarts pause, which is a different figure. Hang
moment: the `t=` the injector writes just before it blocks. Serving again:
the first one-token completion answered 200 by the bench's own poller
(every 0.1 s, 3 s timeout per try). Detection: the watcher's restart
decision (ours: its `restart` event; naive: its third failure).

False restarts under saturating load: a healthy 0.32.2 server with
`--decode-concurrency 1 --prompt-concurrency 1` and long decodes queued
(about 60 s of work, 30 s in --quick; on 0.32.2 `--decode-concurrency 1`
alone does not hold a one-token probe back: its token comes from the
prefill, which runs beside the decode). Ours supervises it (defaults); the
naive prober watches the same server at the same time and counts the
restarts it would have made (each would have killed the requests in
flight). Goals: hang to serving again <= 20 s with ours, and 0 false
restarts.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional


import psutil
import requests

from bench.common import quiet
from bench.timeline import LEAD_S, Traffic
from bench.common import (
    FAULTS_DIR,
    Figure,
    build_model,
    env_python,
    fmt,
    main_python,
    run_main,
    stats,
    table,
    temp_dir,
)
from bench.procs import TimedProcess, TimedServer
from harness.procs import chat
from harness.server import base_env, free_port

from mlx_watchdog import defaults
from mlx_watchdog.probe import Probe

VERSION = "0.32.2"
FAULT = "hang:decode"
FAULT_LINE = re.compile(r"mlx-test-fault: hang at (\w+) t=([0-9.]+)")
GOAL_S = 20.0
SATURATE = ("--decode-concurrency", "1", "--prompt-concurrency", "1")
# The naive prober: Kubernetes liveness-probe defaults (periodSeconds,
# timeoutSeconds, failureThreshold), and its default termination grace.
NAIVE_PERIOD_S, NAIVE_TIMEOUT_S, NAIVE_FAILURES, NAIVE_GRACE_S = 10.0, 1.0, 3, 30.0
LOAD_S = 180.0
AFTER_SERVING_S = 5.0  # traffic kept after serving again, for the timeline


def traffic_timeline(traffic: Optional[Traffic], hang_at: float, serving_at: Optional[float],
                     events) -> Optional[dict]:
    """Keep the traffic a few seconds past serving again, stop it; its timeline."""
    if traffic is None:
        return None
    time.sleep(max(0.0, (serving_at or time.time()) + AFTER_SERVING_S - time.time()))
    traffic.stop()
    return traffic.timeline(hang_at, events)


def fault_env(arm: Path) -> dict:
    return {"PYTHONPATH": str(FAULTS_DIR), "MLX_TEST_FAULT": FAULT,
            "MLX_TEST_FAULT_ARM_FILE": str(arm)}


def server_args(model: Path, port: int, *extra: str) -> List[str]:
    return [str(env_python(VERSION)), "-m", "mlx_lm", "server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), *extra]


# -- clients ------------------------------------------------------------------------------


def wait_serving(url: str, deadline: float) -> Optional[float]:
    """Poll one-token completions until one is answered 200; when (time.time())."""
    while time.time() < deadline:
        try:
            response = chat(url, "are you there", max_tokens=1, timeout=(0.5, 3))
            if response.status_code == 200 and response.json().get("choices"):
                return time.time()
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.1)
    return None


def hang_now(url: str, arm: Path, out, start_line: int) -> Optional[float]:
    """Arm the fault, send one request to strike it, disarm; the hang moment."""
    arm.touch()
    threading.Thread(target=lambda: quiet(lambda: chat(url, "tell me a story",
                                                            max_tokens=50, timeout=60)),
                     daemon=True).start()
    hit = out.wait_line(FAULT_LINE, 60, start_line)
    arm.unlink()  # the restarted server must not hang again
    return float(hit[2].group(2)) if hit else None



# -- ours: mlx-watchdog supervise, defaults ---------------------------------------------------


def events(out, start: int = 0):
    for i, (t, text) in enumerate(out.lines[start:], start):
        if text.startswith("{"):
            try:
                event = json.loads(text)
            except ValueError:
                continue
            if isinstance(event, dict) and "event" in event:
                yield i, t, event


def wait_event(out, predicate, start: int, timeout: float):
    found = []

    def check():
        for hit in events(out, start):
            if predicate(hit[2]):
                found.append(hit)
                return True
        return out.exited_at is not None

    out.wait_for(check, timeout)
    return found[0] if found else None


def track_children(sup: TimedProcess, seen: set) -> None:
    """Register every child the supervisor started, so cleanup can kill its group."""
    for _, _, e in events(sup.out):
        pid = e.get("pid")
        if not isinstance(pid, int):
            m = re.search(r"started pid (\d+)", e.get("message", "")) if e.get(
                "event") == "restarted" else None
            pid = int(m.group(1)) if m else None
        if pid and pid not in seen:
            seen.add(pid)
            try:
                sup.extra_groups.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass


def start_supervise(work: Path, name: str, port: int, model: Path, extra_env: dict,
                    server_extra=()) -> TimedProcess:
    argv = [str(main_python()), "-m", "mlx_watchdog", "supervise", "--log-format", "json",
            "--state-file", str(work / f"state-{name}.json"), "--",
            *server_args(model, port, *server_extra)]
    return TimedProcess(argv, base_env(shim=False, extra=extra_env), work / f"{name}.log")


def ours_hangs(fig: Figure, model: Path, work: Path, hangs: int) -> dict:
    """`hangs` hangs, a fresh supervisor for every MAX_RESTARTS of them: more
    restarts than that in RESTART_WINDOW_S is, by default, a crash loop (and
    restarts pause), which is not what this figure measures."""
    records: List[dict] = []
    batches = 0
    while len(records) < hangs:
        batches += 1
        count = min(defaults.MAX_RESTARTS, hangs - len(records))
        records += ours_batch(fig, model, work, count, batches, first=len(records))
    return {"hangs": records, "supervisors": batches}


def ours_batch(fig: Figure, model: Path, work: Path, hangs: int, batch: int,
               first: int) -> List[dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    arm = work / "arm-ours"
    sup = start_supervise(work, f"ours-{batch}", port, model, fault_env(arm))
    seen: set = set()
    records = []
    try:
        if wait_serving(url, time.time() + LOAD_S) is None:
            raise RuntimeError(f"the supervised server never served:\n{sup.out.text()[-3000:]}")
        start = 0
        for i in range(first, first + hangs):
            healthy = wait_event(sup.out, lambda e: e.get("state") == "healthy", start, 120)
            if healthy is None:
                raise RuntimeError(f"not healthy again:\n{sup.out.text()[-3000:]}")
            track_children(sup, seen)
            # The first hang carries steady client traffic, for the timeline plot.
            traffic = Traffic(url).start() if i == 0 else None
            if traffic is not None:
                time.sleep(LEAD_S)
            # A random moment of the 5 s probe cycle.
            time.sleep(random.uniform(0, defaults.PROBE_INTERVAL_S))
            start = len(sup.out.lines)
            hang_at = hang_now(url, arm, sup.out, start)
            if hang_at is None:
                if traffic is not None:
                    traffic.stop()
                records.append({"hang_at": None})
                continue
            serving_at = wait_serving(url, hang_at + 120)
            restart = wait_event(sup.out, lambda e: e.get("event") == "restart", start, 30)
            timeline = traffic_timeline(traffic, hang_at, serving_at, [
                (restart[1] if restart else None, "restart decided"),
                (serving_at, "serving again")])
            record = {
                "hang_at": hang_at,
                "supervisor": batch,
                "hang_to_restart_s": (restart[1] - hang_at) if restart else None,
                "cause": restart[2].get("cause") if restart else None,
                "reason": restart[2].get("message") if restart else None,
                "hang_to_serving_s": (serving_at - hang_at) if serving_at else None,
            }
            if timeline:
                record["timeline"] = timeline
            records.append(record)
            fig.log(f"  ours #{i + 1}: restart {fmt(record['hang_to_restart_s'], ' s', 1)} "
                    f"({record['cause']}), serving again "
                    f"{fmt(record['hang_to_serving_s'], ' s', 1)}")
            start = restart[0] if restart else start
        track_children(sup, seen)
    finally:
        sup.stop()
    return records


# -- naive: a Kubernetes-style fixed-threshold prober --------------------------------------------


class NaiveProber:
    """Every period a one-token probe with a 1 s timeout; after `failures` failures
    in a row it restarts (restart() given) or only counts the restart it would make."""

    def __init__(self, url: str, restart: Optional[Callable[[], None]] = None):
        self.probe = Probe(url, timeout=NAIVE_TIMEOUT_S)
        self.restart = restart
        self.decisions: List[float] = []  # time.time() of each restart decision
        self.probes: List[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "NaiveProber":
        self._thread.start()
        return self

    def _run(self) -> None:
        failures = 0
        next_at = time.monotonic()
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += NAIVE_PERIOD_S
            result = self.probe()
            self.probes.append({"time": time.time(), "ok": result.ok, "reason": result.reason})
            failures = 0 if result.ok else failures + 1
            if failures >= NAIVE_FAILURES:
                self.decisions.append(time.time())
                failures = 0
                if self.restart is not None:
                    self.restart()
                    next_at = time.monotonic() + NAIVE_PERIOD_S

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(NAIVE_PERIOD_S + NAIVE_GRACE_S + 30)


class NaiveSupervisor:
    """The server run by the naive prober: restart = SIGTERM the group, SIGKILL after
    the grace, start it again on the same port."""

    def __init__(self, model: Path, work: Path, port: int, extra_env: dict):
        self.model, self.work, self.port, self.extra_env = model, work, port, extra_env
        self.server: Optional[TimedServer] = None
        self.starts = 0
        self.start()

    def start(self) -> None:
        self.starts += 1
        self.server = TimedServer(VERSION, self.model, self.work, shim=True, env=self.extra_env,
                                  port=self.port)
        self.server.log_path = self.work / f"naive-{self.starts}.log"
        self.server.start()

    def restart(self) -> None:
        server = self.server
        if server.exited_at is None:
            try:
                os.killpg(server.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            server.wait_exit(NAIVE_GRACE_S)
        server.stop()  # SIGKILL if still there
        self.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def naive_hangs(fig: Figure, model: Path, work: Path, hangs: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    arm = work / "arm-naive"
    sup = NaiveSupervisor(model, work, port, fault_env(arm))
    records = []
    try:
        if wait_serving(url, time.time() + LOAD_S) is None:
            raise RuntimeError(f"the naive server never served:\n{sup.server.log()[-3000:]}")
        prober = NaiveProber(url, restart=sup.restart).start()
        try:
            for i in range(hangs):
                traffic = Traffic(url).start() if i == 0 else None  # for the timeline plot
                time.sleep(random.uniform(0, NAIVE_PERIOD_S) + (LEAD_S if traffic else 0.0))
                server = sup.server
                decided = len(prober.decisions)
                hang_at = hang_now(url, arm, server.out, len(server.out.lines))
                if hang_at is None:
                    if traffic is not None:
                        traffic.stop()
                    records.append({"hang_at": None})
                    continue
                serving_at = wait_serving(url, hang_at + 180)
                decision = prober.decisions[decided] if len(prober.decisions) > decided else None
                record = {
                    "hang_at": hang_at,
                    "hang_to_restart_s": (decision - hang_at) if decision else None,
                    "hang_to_serving_s": (serving_at - hang_at) if serving_at else None,
                }
                timeline = traffic_timeline(traffic, hang_at, serving_at, [
                    (decision, "restart decided"), (serving_at, "serving again")])
                if timeline:
                    record["timeline"] = timeline
                records.append(record)
                fig.log(f"  naive #{i + 1}: restart {fmt(record['hang_to_restart_s'], ' s', 1)}, "
                        f"serving again {fmt(record['hang_to_serving_s'], ' s', 1)}")
                # Let its count start afresh after the restart, as after a real boot.
                time.sleep(1)
        finally:
            prober.stop()
    finally:
        sup.stop()
    return {"hangs": records}


# -- saturating load: false restarts -------------------------------------------------------------


LONG_TOKENS = 1500  # per queued request; the decode rate is measured at this length


def decode_rate(url: str, tokens: int = LONG_TOKENS) -> float:
    started = time.time()
    response = chat(url, "measure", max_tokens=tokens, timeout=300)
    response.raise_for_status()
    return tokens / (time.time() - started)


def saturation(fig: Figure, model: Path, work: Path, seconds: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sup = start_supervise(work, "saturated", port, model, {}, SATURATE)
    seen: set = set()
    try:
        if wait_serving(url, time.time() + LOAD_S) is None:
            raise RuntimeError(f"the supervised server never served:\n{sup.out.text()[-3000:]}")
        if wait_event(sup.out, lambda e: e.get("state") == "healthy", 0, 120) is None:
            raise RuntimeError(f"never healthy:\n{sup.out.text()[-3000:]}")
        track_children(sup, seen)
        rate = decode_rate(url)
        max_tokens = LONG_TOKENS
        requests_n = max(3, round(seconds * rate / max_tokens))
        start_line = len(sup.out.lines)
        naive = NaiveProber(url).start()  # watches the same server, counts only
        began = time.time()
        results: Dict[int, dict] = {}

        def send(i: int) -> None:
            try:
                r = chat(url, f"long story {i}", max_tokens=max_tokens,
                              timeout=seconds * 10 + 300)
                tokens = r.json().get("usage", {}).get("completion_tokens")
                results[i] = {"status": r.status_code, "tokens": tokens, "at": time.time()}
            except (requests.RequestException, ValueError) as exc:
                results[i] = {"status": None, "error": type(exc).__name__, "at": time.time()}

        threads = [threading.Thread(target=send, args=(i,), daemon=True)
                   for i in range(requests_n)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(seconds * 10 + 330)
        busy_s = time.time() - began
        time.sleep(NAIVE_PERIOD_S)  # one more cycle of both, on the idle server
        naive.stop()
        track_children(sup, seen)
        ours_events = [e for _, _, e in events(sup.out, start_line)]
        ours_restarts = [e for e in ours_events if e.get("event") == "restart"]
        states = [e.get("state") for e in ours_events if e.get("event") == "state"]
        completed = [r for r in results.values()
                     if r.get("status") == 200 and r.get("tokens") == max_tokens]
        naive_failed = [p for p in naive.probes if not p["ok"]]
        record = {
            "decode_rate_tok_s": rate, "requests": requests_n, "max_tokens": max_tokens,
            "saturated_s": busy_s, "completed": len(completed), "results": results,
            "ours_restarts": len(ours_restarts), "ours_states": states,
            "ours_busy_seen": "busy" in states,
            "naive_would_restart": len(naive.decisions),
            "naive_decisions_after_start_s": [d - began for d in naive.decisions],
            "naive_probes": len(naive.probes), "naive_failed_probes": len(naive_failed),
        }
        fig.log(f"  saturated {busy_s:.0f} s: ours {len(ours_restarts)} restarts "
                f"(states {states}), naive would restart {len(naive.decisions)} times; "
                f"{len(completed)}/{requests_n} long requests complete")
        return record
    finally:
        sup.stop()


# -- the figure ------------------------------------------------------------------------------------


def main() -> int:
    fig = Figure("hang_to_serving", "Figure 2: hang to serving again", __doc__)
    hangs = 3 if fig.quick else 10
    saturate_s = 30.0 if fig.quick else 60.0
    work = temp_dir("bench-hang-")
    model = build_model("llama", work / "llama")
    random.seed(0)

    fig.log(f"ours: mlx-watchdog supervise (defaults), {hangs} hangs")
    ours = ours_hangs(fig, model, work, hangs)
    fig.log(f"naive: {NAIVE_PERIOD_S:g} s period, {NAIVE_TIMEOUT_S:g} s timeout, "
            f"{NAIVE_FAILURES} failures; {hangs} hangs")
    naive = naive_hangs(fig, model, work, hangs)
    fig.log(f"saturating load: ~{saturate_s:g} s of queued decodes")
    sat = saturation(fig, model, work, saturate_s)

    def col(run, key):
        return stats([r.get(key) for r in run["hangs"] if r.get(key) is not None])

    rows, summary = [], {}
    for label, run in (("`mlx-watchdog supervise`, defaults", ours),
                       (f"naive prober ({NAIVE_PERIOD_S:g} s period, {NAIVE_TIMEOUT_S:g} s "
                        f"timeout, {NAIVE_FAILURES} failures)", naive)):
        serve, detect = col(run, "hang_to_serving_s"), col(run, "hang_to_restart_s")
        rows.append([label, f"{serve['n']}/{len(run['hangs'])}",
                     f"{fmt(detect['median'], ' s', 1)} / {fmt(detect['max'], ' s', 1)}",
                     f"**{fmt(serve['median'], ' s', 1)}** / {fmt(serve['max'], ' s', 1)}"])
    ours_serve = col(ours, "hang_to_serving_s")
    naive_serve = col(naive, "hang_to_serving_s")
    causes = sorted({r.get("cause") for r in ours["hangs"] if r.get("cause")})
    goal_time = bool(ours_serve["n"]) and ours_serve["n"] == len(ours["hangs"]) and \
        ours_serve["max"] <= GOAL_S
    goal_false = sat["ours_restarts"] == 0 and sat["completed"] == sat["requests"]
    summary = {
        "ours_hang_to_serving_median_s": ours_serve["median"],
        "ours_hang_to_serving_max_s": ours_serve["max"],
        "naive_hang_to_serving_median_s": naive_serve["median"],
        "naive_hang_to_serving_max_s": naive_serve["max"],
        "ours_restart_causes": causes,
        "ours_false_restarts": sat["ours_restarts"],
        "naive_false_restarts": sat["naive_would_restart"],
        "meets_time_goal": goal_time,
        "meets_false_restart_goal": goal_false,
    }
    body = (f"**Hang to serving again** (median / max over {hangs} hangs; goal: ≤ {GOAL_S:g} s "
            f"with ours: **{'met' if goal_time else 'not met'}**)\n\n")
    body += table(["watcher", "served again", "hang → restart decision", "hang → serving again"],
                  rows)
    body += (f"\n\nOurs restarted for: {', '.join(causes) or 'n/a'}.\n\n"
             f"**False restarts of a saturated, healthy server** (goal: 0 with ours: "
             f"**{'met' if goal_false else 'not met'}**)\n\n")
    body += table(
        ["watcher", "saturated for", "restarts", "long requests completed"],
        [["`mlx-watchdog supervise`, defaults", fmt(sat["saturated_s"], " s", 0),
          f"**{sat['ours_restarts']}** (judged busy: {'yes' if sat['ours_busy_seen'] else 'no'})",
          f"{sat['completed']}/{sat['requests']}"],
         ["naive prober (same server, same time; counted, not done)",
          fmt(sat["saturated_s"], " s", 0), f"**{sat['naive_would_restart']}** "
          f"({sat['naive_failed_probes']}/{sat['naive_probes']} probes failed)",
          "each restart would have killed the requests in flight"]])
    body += (
        f"\n\nHang: `MLX_TEST_FAULT={FAULT}` (harness/faults) on stock mlx-lm {VERSION}, "
        "armed after the warm-up and struck by one request at a random moment of the probe "
        "cycle; the loop blocks at 0% CPU while /health stays 200. Hang moment: the `t=` the "
        "injector writes just before it blocks. Serving again: the first one-token completion "
        "answered 200, polled every 0.1 s. Ours: `mlx-watchdog supervise` with default "
        f"settings (probe every {defaults.PROBE_INTERVAL_S:g} s, {defaults.PROBE_TIMEOUT_S:g} s "
        f"timeout, heartbeat timeout {defaults.HEARTBEAT_TIMEOUT_S:g} s: one failed probe once "
        "the shim's heartbeat is that old), a fresh supervisor every "
        f"{defaults.MAX_RESTARTS} hangs (by default more restarts than that in "
        f"{defaults.RESTART_WINDOW_S:g} s is a crash loop: restarts pause). "
        "Naive: the Kubernetes liveness-probe defaults "
        "(periodSeconds 10, timeoutSeconds 1, failureThreshold 3), the same one-token "
        "completion, then SIGTERM and a new server. Saturation: "
        f"`--decode-concurrency 1 --prompt-concurrency 1`, {sat['requests']} requests of "
        f"{sat['max_tokens']} tokens queued at once (one such request alone decodes at "
        f"{sat['decode_rate_tok_s']:.0f} tokens/s); tiny random llama, CPU.")
    arms = {label: next((r["timeline"] for r in run["hangs"] if r.get("timeline")), None)
            for label, run in (("naive prober, stock server", naive),
                               ("shim + mlx-watchdog supervise", ours))}
    timelines = {} if None in arms.values() else {"hang": {
        "title": f"a hung generation loop, mlx-lm {VERSION}: requests answered per second",
        "zero": "hang", "arms": arms}}
    body += (" Plot: the first hang of each watcher under steady traffic (bench/timeline.py: "
             f"2 clients, one 4-token completion after another, 10 s read timeout, from "
             f"{LEAD_S:g} s before the hang).")
    fig.write({"ours": ours, "naive": naive, "saturation": sat, "goal_s": GOAL_S,
               "timelines": timelines,
               "naive_settings": {"period_s": NAIVE_PERIOD_S, "timeout_s": NAIVE_TIMEOUT_S,
                                  "failures": NAIVE_FAILURES, "grace_s": NAIVE_GRACE_S}},
              body, summary)
    return 0


if __name__ == "__main__":
    run_main(main)
