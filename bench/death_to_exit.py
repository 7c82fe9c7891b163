"""Figure 1: death to exit (shim), death to serving again (supervise), vs stock.

Three deaths of the generation thread, each on a real stock mlx_lm.server
(tiny random llama, CPU):

  fault 0.31.3 / 0.32.2   injected by harness/faults, armed after the
                          warm-up: MLX_TEST_FAULT=raise:resource:decode:2
                          (the real `[metal::malloc] Resource limit` message)
                          while three clients wait: a stream and a plain
                          request in flight (200 tokens each), and a queued
                          one (a seeded request waits for the batch to drain).
  extend 0.31.3           the real upstream crash (harness/repro.py):
                          two requests merge in PromptProcessingBatch.extend,
                          shim with MLX_HOTFIX_DISABLE=extend. Clients: A and B.

Death moment (wall clock, time.time(), same host):
  fault   the `t=` on the injector's `mlx-test-fault: raise at decode t=...`
          line, written just before it raises.
  extend  the `t=` on `bench-death: ... t=...`, written by the bench-only
          fault injector (harness/faults, MLX_TEST_DEATH_STAMP=1) when the exception leaves
          BatchGenerator.next() -- the generation loop's own call, before
          any handler (shim or stock) sees it. The first client-observed
          503 is recorded too.
Exit moment: waitpid() returning in the parent (a thread blocked on it).
Client answer: the moment the bench's client thread has the whole answer.

For each death the three modes are:
  shim       PYTHONPATH=sitecustomize: death -> exit, and every waiting
             client's answer (a 503 JSON, or a final SSE error event).
  supervise  `mlx-watchdog supervise --probe-interval 1 -- <env python> -m
             mlx_lm server ...`: death -> child exit (polled) -> respawn ->
             serving again (the first completion answered 200).
  stock      no shim: wait a window after the death, then report whether the
             process exited, /health, and whether a new completion succeeds.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from pathlib import Path
from typing import List, Optional


import psutil
import requests

from bench.common import (
    FAULTS_DIR,
    SHIM_DIR,
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
from bench.procs import (
    COMPLETED,
    TOLD,
    Client,
    SentRequest,
    TimedProcess,
    TimedServer,
)
from bench.timeline import LEAD_S, Traffic
from harness.procs import chat, chat_body
from harness.repro import EXTEND_CRASH_ARGS, PENALTY, long_prompt
from harness.server import base_env, free_port

FAULT = "raise:resource:decode:2"
FAULT_LINE = re.compile(r"mlx-test-fault: raise at (\w+) t=([0-9.]+)")
STAMP_LINE = re.compile(r"bench-death: (.*) t=([0-9.]+)$")
CASES = (("fault", "0.31.3"), ("fault", "0.32.2"), ("extend", "0.31.3"))
GOAL_S = 0.5
CLIENT_TIMEOUT = 60.0
EXTEND_ATTEMPTS = 5  # the extend crash depends on timing: retry a pair that did not crash
AFTER_SERVING_S = 5.0  # traffic kept after serving again, for the timeline


def traffic_hooks(traffic: Traffic, cause: str, before=None, after=None):
    """before()/after() for trigger_until_death that keep the traffic off the
    `extend` pair: the crash needs the two requests alone in the batch."""
    if cause != "extend":
        return before, after

    def held_before():
        traffic.hold()
        if before:
            before()

    def released_after(hit):
        if after:
            after(hit)
        traffic.release()

    return held_before, released_after


def case_env(cause: str, arm: Path, *, shim: bool) -> dict:
    """Extra environment of the server (or of the supervisor, which adds the shim)."""
    path = ([str(SHIM_DIR)] if shim else []) + [str(FAULTS_DIR)]
    if cause == "fault":
        env = {"MLX_TEST_FAULT": FAULT, "MLX_TEST_FAULT_ARM_FILE": str(arm)}
    else:  # the natural crash: the injector only stamps the moment of death
        env = {"MLX_TEST_DEATH_STAMP": "1", "MLX_HOTFIX_DISABLE": "extend"}
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def case_args(cause: str) -> tuple:
    return EXTEND_CRASH_ARGS if cause == "extend" else ()


def death_pattern(cause: str):
    return FAULT_LINE if cause == "fault" else STAMP_LINE


def warm_request(url: str, cause: str, timeout: float = 120) -> requests.Response:
    # The extend crash needs a warm-up with a penalty (harness/repro.py).
    extra = {"repetition_penalty": PENALTY} if cause == "extend" else {}
    return chat(url, "warm up", max_tokens=1, timeout=timeout, **extra)


def trigger(cause: str, url: str, arm: Path, seed: int, timeout: float) -> List[Client]:
    """Send the clients, then arm the fault (or send the crash pair); the clients.

    Every request is fully written to the server's socket before the fault is
    armed, and the fault is armed only once the stream's first event is out
    (the batch is decoding): so all three are waiting at the server when it
    strikes, a few decode steps later."""
    if cause == "fault":
        prompt = "tell me more " * 40
        clients = [
            SentRequest("stream", url, chat_body(prompt, max_tokens=200, stream=True),
                        timeout=timeout),
            SentRequest("plain", url, chat_body(prompt + "!", max_tokens=200), timeout=timeout),
            # A seeded request cannot join the batch: it waits for the batch to drain.
            SentRequest("queued", url, chat_body("queued", max_tokens=5, seed=7),
                        timeout=timeout),
        ]
        clients[0].wait_first_data(30)
        arm.touch()
        return clients
    prompt = long_prompt(seed)
    a = SentRequest("A", url, chat_body(prompt, max_tokens=20), timeout=timeout)
    time.sleep(0.05)
    b = SentRequest("B", url, chat_body(prompt + " and then some more", max_tokens=20,
                                        repetition_penalty=PENALTY), timeout=timeout)
    return [a, b]


def trigger_until_death(cause, url, out, arm, seed, timeout, *, before=None, after=None):
    """Trigger; wait for the death line. Retries the extend pair if it did not crash.

    before()/after() run around each attempt (after() gets the hit or None)."""
    attempts = EXTEND_ATTEMPTS if cause == "extend" else 1
    for attempt in range(attempts):
        if before:
            before()
        start = len(out.lines)
        clients = trigger(cause, url, arm, seed * 100 + attempt, timeout)
        hit = out.wait_line(death_pattern(cause), 60, start)
        if after:
            after(hit)
        if hit:
            return clients, hit, attempt + 1
        for c in clients:
            c.join(timeout)
    return clients, None, attempts


def client_summary(clients: List[Client], death_at: float, exited_at: Optional[float]) -> dict:
    records = [c.record(death_at) for c in clients]
    waiting = [r for r in records if r["finished_at"] is None or r["finished_at"] > death_at]
    answered = [r for r in waiting if r["outcome"] in (COMPLETED, TOLD)]
    last = max((r["finished_at"] for r in waiting if r["finished_at"]), default=None)
    return {
        "clients": records,
        "waiting_at_death": len(waiting),
        "answered": len(answered),
        "all_answered": len(answered) == len(waiting),
        "max_answer_after_death_s": (last - death_at) if last is not None else None,
        # Observed by the bench's client threads: <= 0 means seen before waitpid returned.
        "last_answer_minus_exit_s": (last - exited_at) if (last and exited_at) else None,
        "first_told_at": min((r["finished_at"] for r in waiting if r["outcome"] == TOLD),
                             default=None),
    }


# -- shim: death -> exit -------------------------------------------------------------------


def shim_death(fig: Figure, cause: str, version: str, model: Path, work: Path, i: int) -> dict:
    arm = work / f"arm-shim-{cause}-{version}-{i}"
    server = TimedServer(version, model, work, env=case_env(cause, arm, shim=True),
                         args=case_args(cause))
    server.start()
    try:
        server.wait_listening(120)
        assert warm_request(server.url, cause).status_code == 200, server.log()[-2000:]
        clients, hit, attempts = trigger_until_death(cause, server.url, server.out, arm, i,
                                                     CLIENT_TIMEOUT)
        if hit is None:
            return {"death": None, "attempts": attempts, "log_tail": server.log()[-2000:]}
        _, seen_at, match = hit
        death_at = float(match.group(2))
        code = server.wait_exit(30)
        for c in clients:
            c.join(CLIENT_TIMEOUT + 5)
        record = {
            "death_at": death_at, "death_line_seen_at": seen_at, "death_line": match.group(0),
            "attempts": attempts, "exit_code": code, "exited_at": server.exited_at,
            "death_to_exit_s": (server.exited_at - death_at) if server.exited_at else None,
            "hotfix_line": next((t for _, t in server.out.lines
                                 if t.startswith("mlx-hotfix: generation thread died")), None),
        }
        record.update(client_summary(clients, death_at, server.exited_at))
        if not record["all_answered"]:
            record["log_tail"] = server.log()[-4000:]
        if record["first_told_at"]:
            record["death_to_first_503_s"] = record["first_told_at"] - death_at
        return record
    finally:
        server.stop()


# -- stock: the zombie -------------------------------------------------------------------------


def stock_zombie(fig: Figure, cause: str, version: str, model: Path, work: Path,
                 window: float) -> dict:
    arm = work / f"arm-stock-{cause}-{version}"
    server = TimedServer(version, model, work, shim=False, env=case_env(cause, arm, shim=False),
                         args=case_args(cause))
    server.start()
    traffic = None
    try:
        server.wait_listening(120)
        assert warm_request(server.url, cause).status_code == 200, server.log()[-2000:]
        traffic = Traffic(server.url).start()
        time.sleep(LEAD_S)
        # The extend crash needs a fresh penalty warm-up after the traffic.
        rewarm = (lambda: warm_request(server.url, cause)) if cause == "extend" else None
        before, after = traffic_hooks(traffic, cause, before=rewarm)
        clients, hit, attempts = trigger_until_death(cause, server.url, server.out, arm, 0, window,
                                                     before=before, after=after)
        if hit is None:
            return {"death": None, "attempts": attempts}
        death_at = float(hit[2].group(2))
        server.wait_exit(max(0.0, death_at + window - time.time()))
        waited = time.time() - death_at
        traffic.stop()
        for c in clients:
            c.join(max(0.0, death_at + window + 5 - time.time()))
        alive = server.exited_at is None
        health = server.health(timeout=5)
        fresh = Client("new", lambda: chat(server.url, "are you there", max_tokens=1,
                                                timeout=10))
        fresh.join(15)
        summary = client_summary(clients, death_at, server.exited_at)
        return {
            "death_at": death_at, "death_line": hit[2].group(0), "attempts": attempts,
            "waited_s": waited, "exited": not alive, "exit_code": server.out.returncode,
            "health_after": health, "new_completion": fresh.record(),
            "new_completion_ok": fresh.outcome() == COMPLETED,
            "timeline": traffic.timeline(death_at),
            **summary,
        }
    finally:
        if traffic is not None:
            traffic.stop()
        server.stop()


# -- supervise: death -> serving again -----------------------------------------------------------


def _events(out, start: int = 0):
    for i, (t, text) in enumerate(out.lines[start:], start):
        if text.startswith("{"):
            try:
                event = json.loads(text)
            except ValueError:
                continue
            yield i, t, event


def _child_pid(event: dict) -> Optional[int]:
    if event.get("event") not in ("spawned", "restarted"):
        return None
    if isinstance(event.get("pid"), int):
        return event["pid"]
    m = re.search(r"started pid (\d+)", event.get("message", ""))
    return int(m.group(1)) if m else None


def _wait_event(out, predicate, start: int, timeout: float):
    found = []

    def check():
        for i, t, e in _events(out, start):
            if predicate(e):
                found.append((i, t, e))
                return True
        return out.exited_at is not None

    out.wait_for(check, timeout)
    return found[0] if found else None


class ExitWatch:
    """Polls a (not our own) child process until it is a zombie or gone."""

    def __init__(self, proc: "psutil.Process", interval: float = 0.002):
        self.proc = proc
        self.exited_at: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            try:
                if self.proc.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(interval)
        else:
            return
        self.exited_at = time.time()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def wait_serving(url: str, cause: str, deadline: float) -> Optional[float]:
    """Poll with one-token completions until one is answered 200; when."""
    while time.time() < deadline:
        try:
            response = warm_request(url, cause, timeout=(0.5, 30))
            if response.status_code == 200 and response.json().get("choices"):
                return time.time()
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.05)
    return None


def supervised(fig: Figure, cause: str, version: str, model: Path, work: Path,
               deaths: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    arm = work / f"arm-sup-{cause}-{version}"
    argv = [str(main_python()), "-m", "mlx_watchdog", "supervise", "--probe-interval", "1",
            "--max-restarts", "1000", "--stop-grace", "3",
            "--state-file", str(work / f"state-{cause}-{version}.json"), "--log-format", "json",
            "--", str(env_python(version)), "-m", "mlx_lm", "server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), *case_args(cause)]
    env = base_env(shim=False, extra=case_env(cause, arm, shim=False))
    sup = TimedProcess(argv, env, work / f"supervise-{cause}-{version}.log")
    command = " ".join(["<main python> -m mlx_watchdog supervise --probe-interval 1 "
                        "--max-restarts 1000 --stop-grace 3 --state-file S --log-format json --",
                        f"<{version} python> -m mlx_lm server --model M --host 127.0.0.1 --port P",
                        *case_args(cause)])
    records = []
    seen_pids = set()

    def track_children(start=0):
        pid = None
        for _, _, e in _events(sup.out, start):
            p = _child_pid(e)
            if p and p not in seen_pids:
                seen_pids.add(p)
                try:
                    sup.extra_groups.append(psutil.Process(p))
                except psutil.NoSuchProcess:
                    pass
            pid = p or pid
        return pid

    try:
        if wait_serving(url, cause, time.time() + 180) is None:
            raise RuntimeError(f"supervised server never served:\n{sup.out.text()[-3000:]}")
        healthy = _wait_event(sup.out, lambda e: e.get("state") == "healthy", 0, 60)
        rng = random.Random(1)
        before = after = None
        if cause == "extend":
            # The supervisor's own one-token probes (every 1 s) join the pair's
            # prefill, and then the crash does not happen on 0.31.3 (0 of 6
            # tries with a one-token request every second). So the supervisor
            # is paused (SIGSTOP) from a fresh penalty warm-up until the death
            # line arrives (about a millisecond after the death, before the
            # child exits), then resumed (SIGCONT): everything from the exit on
            # is the supervisor's own doing.
            def before():
                sup.pause()
                time.sleep(0.3)  # a probe in flight finishes
                warm_request(url, cause)

            def after(hit):
                sup.resume()
        for i in range(deaths):
            child_pid = track_children()
            # The first death carries steady client traffic, for the timeline plot;
            # not the extend pair's, sent with the supervisor paused: the server's
            # output goes through the supervisor (its [server] lines), and a paused
            # one stops reading it, so steady traffic would fill the pipe and block
            # the server's request threads on their log lines.
            traffic = Traffic(url).start() if i == 0 and cause != "extend" else None
            if traffic is not None:
                time.sleep(LEAD_S)
            if cause == "fault":
                # Death at a random moment of the supervisor's 1 s probe cycle.
                time.sleep(rng.uniform(0.0, 1.0))
            watch = ExitWatch(psutil.Process(child_pid))
            start = len(sup.out.lines)
            hooks = traffic_hooks(traffic, cause, before, after) if traffic else (before, after)
            clients, hit, attempts = trigger_until_death(cause, url, sup.out, arm, i,
                                                         CLIENT_TIMEOUT, before=hooks[0],
                                                         after=hooks[1])
            if hit is None:
                watch.stop()
                if traffic is not None:
                    traffic.stop()
                records.append({"death": None, "attempts": attempts})
                continue
            death_index, _, match = hit
            death_at = float(match.group(2))
            if cause == "fault":
                arm.unlink()  # the restarted child must not die again
            serving_at = wait_serving(url, cause, death_at + 120)
            exited = _wait_event(sup.out, lambda e: e.get("event") == "exited", start, 30)
            restarted = _wait_event(sup.out, lambda e: e.get("event") == "restarted", start, 30)
            healthy = _wait_event(sup.out, lambda e: e.get("state") == "healthy",
                                  restarted[0] if restarted else start, 60)
            watch.stop()
            track_children(start)
            for c in clients:
                c.join(CLIENT_TIMEOUT + 5)
            record = {
                "death_at": death_at, "death_line": match.group(0), "attempts": attempts,
                "child_pid": child_pid,
                "child_exit_code": exited[2].get("returncode") if exited else None,
                "death_to_child_exit_s": (watch.exited_at - death_at) if watch.exited_at else None,
                "death_to_supervisor_saw_exit_s": (exited[1] - death_at) if exited else None,
                "death_to_respawn_s": (restarted[1] - death_at) if restarted else None,
                "death_to_serving_s": (serving_at - death_at) if serving_at else None,
                "healthy_again": healthy is not None,
            }
            if traffic is not None:
                time.sleep(max(0.0, (serving_at or time.time()) + AFTER_SERVING_S - time.time()))
                traffic.stop()
                record["timeline"] = traffic.timeline(death_at, [
                    (watch.exited_at, "child exited"),
                    (restarted[1] if restarted else None, "restarted"),
                    (serving_at, "serving again")])
            record.update(client_summary(clients, death_at, watch.exited_at))
            records.append(record)
            fig.log(f"  supervise {cause} {version} #{i + 1}: "
                    f"exit {fmt(record['death_to_child_exit_s'], ' s')}, "
                    f"respawn {fmt(record['death_to_respawn_s'], ' s')}, "
                    f"serving {fmt(record['death_to_serving_s'], ' s')}")
    finally:
        sup.stop()
    return {"command": command, "deaths": records}


# -- the figure ------------------------------------------------------------------------------------


def _s(values):
    return stats([v for v in values if v is not None])


def main() -> int:
    def arguments(parser):
        parser.add_argument("--cases", default=",".join(f"{c}-{v}" for c, v in CASES),
                            help="comma list of cases to run [default: all: %(default)s]")
        parser.add_argument("--deaths", type=int, default=None,
                            help="deaths per case and mode [default: 10; --quick: 3]")
        parser.add_argument("--window", type=float, default=None,
                            help="seconds to watch the stock zombie [default: 30; --quick: 10]")

    fig = Figure("death_to_exit", "Figure 1: death to exit, and to serving again", __doc__,
                 add_arguments=arguments)
    deaths = fig.args.deaths or (3 if fig.quick else 10)
    window = fig.args.window or (10.0 if fig.quick else 30.0)
    wanted = [c.strip() for c in fig.args.cases.split(",") if c.strip()]
    cases = [(c, v) for c, v in CASES if f"{c}-{v}" in wanted]
    if len(cases) != len(wanted):
        raise SystemExit(f"unknown case in --cases {fig.args.cases!r}; "
                         f"known: {', '.join(f'{c}-{v}' for c, v in CASES)}")
    work = temp_dir("bench-death-")
    model = build_model("llama", work / "llama")
    results = {"deaths_per_case": deaths, "stock_window_s": window, "fault": FAULT,
               "goal_s": GOAL_S, "cases": {}}

    for cause, version in cases:
        key = f"{cause}-{version}"
        fig.log(f"{key}: shim, {deaths} deaths")
        shim = []
        for i in range(deaths):
            record = shim_death(fig, cause, version, model, work, i)
            shim.append(record)
            fig.log(f"  shim {key} #{i + 1}: exit {record.get('exit_code')} "
                    f"{fmt(record.get('death_to_exit_s'), ' s', 3)} after death; clients "
                    f"{record.get('answered')}/{record.get('waiting_at_death')} answered, last "
                    f"{fmt(record.get('max_answer_after_death_s'), ' s', 3)} after death")
        fig.log(f"{key}: supervise, {deaths} deaths")
        sup = supervised(fig, cause, version, model, work, deaths)
        fig.log(f"{key}: stock, waiting {window:g} s after the death")
        stock = stock_zombie(fig, cause, version, model, work, window)
        fig.log(f"  stock {key}: exited={stock.get('exited')} health={stock.get('health_after')} "
                f"new completion ok={stock.get('new_completion_ok')}")
        results["cases"][key] = {"cause": cause, "version": version, "shim": shim,
                                 "supervise": sup, "stock": stock}

    # -- tables
    rows1, rows2, rows3, summary = [], [], [], {}
    names = {"fault": "injected `resource` fault at decode", "extend": "real `extend` crash"}
    results["timelines"] = {}
    for key, case in results["cases"].items():
        ours = next((r["timeline"] for r in case["supervise"]["deaths"] if r.get("timeline")),
                    None)
        stock = case["stock"].get("timeline")
        if ours and stock:
            results["timelines"][key] = {
                "title": f"{names[case['cause']].replace('`', '')}, mlx-lm {case['version']}: "
                         "requests answered per second",
                "zero": "death",
                "arms": {"stock": stock, "shim + mlx-watchdog supervise": ours}}
    for key, case in results["cases"].items():
        cause, version = case["cause"], case["version"]
        label = f"{names[cause]}, mlx-lm {version}"
        shim = [r for r in case["shim"] if r.get("death_at")]
        exit_s = _s(r.get("death_to_exit_s") for r in shim)
        answer_s = _s(r.get("max_answer_after_death_s") for r in shim)
        codes = sorted({r.get("exit_code") for r in shim}, key=str)
        all_answered = all(r.get("all_answered") for r in shim) and bool(shim)
        waiting = sum(r.get("waiting_at_death", 0) for r in shim)
        answered = sum(r.get("answered", 0) for r in shim)
        before = sum(1 for r in shim if (r.get("last_answer_minus_exit_s") or 0) <= 0)
        meets = bool(exit_s["n"]) and exit_s["max"] <= GOAL_S and all_answered
        rows1.append([label, f"{exit_s['n']}/{len(case['shim'])}",
                      f"**{fmt(exit_s['median'], ' s', 3)}**", fmt(exit_s["p90"], " s", 3),
                      fmt(exit_s["max"], " s", 3), ", ".join(map(str, codes)),
                      f"{answered}/{waiting}", fmt(answer_s["median"], " s", 3),
                      fmt(answer_s["max"], " s", 3), f"{before}/{len(shim)}",
                      "yes" if meets else "**no**"])
        sup = [r for r in case["supervise"]["deaths"] if r.get("death_at")]
        serve_s = _s(r.get("death_to_serving_s") for r in sup)
        cexit_s = _s(r.get("death_to_child_exit_s") for r in sup)
        respawn_s = _s(r.get("death_to_respawn_s") for r in sup)
        sup_answered = sum(r.get("answered", 0) for r in sup)
        sup_waiting = sum(r.get("waiting_at_death", 0) for r in sup)
        rows2.append([label, f"{serve_s['n']}/{len(case['supervise']['deaths'])}",
                      f"{fmt(cexit_s['median'], ' s', 3)} / {fmt(cexit_s['max'], ' s', 3)}",
                      f"{fmt(respawn_s['median'], ' s')} / {fmt(respawn_s['max'], ' s')}",
                      f"**{fmt(serve_s['median'], ' s')}** / {fmt(serve_s['max'], ' s')}",
                      f"{sup_answered}/{sup_waiting}"])
        st = case["stock"]
        new = st.get("new_completion") or {}
        new_text = "succeeded" if st.get("new_completion_ok") else (
            "no answer in 10 s" if new.get("outcome") == "waiting" else
            f"failed: {new.get('status') or new.get('error')}")
        stock_clients = ", ".join(f"{c['name']}: {c['outcome']}"
                                  + (f" {c['status']}" if c["outcome"] == "error" else "")
                                  for c in st.get("clients", []))
        rows3.append([label, fmt(st.get("waited_s"), " s", 0),
                      "no" if not st.get("exited") else f"yes ({st.get('exit_code')})",
                      str(st.get("health_after")), new_text, stock_clients,
                      "**never recovers**" if not st.get("exited") and not st.get("new_completion_ok")
                      else "recovered"])
        summary[key] = {
            "death_to_exit_median_s": exit_s["median"], "death_to_exit_max_s": exit_s["max"],
            "all_clients_answered": all_answered, "meets_goal": meets,
            "death_to_serving_median_s": serve_s["median"], "death_to_serving_max_s": serve_s["max"],
            "stock_recovered": bool(st.get("exited") or st.get("new_completion_ok")),
        }

    body = "**Shim: death to exit** (goal: exit ≤ 0.5 s after the death, every waiting client answered first)\n\n"
    body += table(["death", "deaths", "death → exit median", "p90", "max", "exit code",
                   "waiting clients answered", "last answer after death, median",
                   "max", "last answer seen before exit", "goal met"], rows1)
    body += ("\n\n**`mlx-watchdog supervise --probe-interval 1`: death to serving again** "
             "(median / max)\n\n")
    body += table(["death", "deaths", "death → child exit", "death → respawned",
                   "death → serving again", "waiting clients answered"], rows2)
    body += f"\n\n**Stock, no shim, same death** (waited {window:g} s after it)\n\n"
    body += table(["death", "waited", "process exited", "/health after", "a new completion",
                   "clients waiting at the death", "verdict"], rows3)
    body += (
        "\n\nDeath moment: for the injected fault, the `t=` the injector writes just before it "
        "raises; for the `extend` crash, the `t=` the fault injector (`harness/faults`, `MLX_TEST_DEATH_STAMP=1`) "
        "drop-in writes when the TypeError leaves `BatchGenerator.next()` (before the shim or "
        "stock sees it). Exit: when the parent's `waitpid` returns (shim), or when polling "
        "(every 2 ms) first sees the supervised child a zombie. Serving again: the first "
        "one-token completion answered 200, polled every 50 ms. Answered = a complete 503 JSON "
        "or a final SSE error event (or a normal completion); 'seen before exit' compares the "
        "bench's client threads with the exit observation, both in this process. Fault: "
        f"`{FAULT}`, armed after the warm-up, with a stream and a plain request in flight "
        "and a seeded one queued (all three sent, and the stream's first event out, before the "
        "fault is armed); `extend`: two requests 50 ms apart "
        "(harness/repro.py), shim with `MLX_HOTFIX_DISABLE=extend`. Under supervise, the "
        "`extend` pair is sent with the supervisor paused (SIGSTOP; its 1 s one-token probes "
        "would join the prefill batch, and then the crash does not happen), and resumed as "
        "soon as the death line arrives, before the child exits. Tiny random llama, CPU. "
        "Plots: the stock zombie and the first supervised death of each case under steady "
        "traffic (bench/timeline.py: 2 clients, one 4-token completion after another, 10 s "
        f"read timeout, from {LEAD_S:g} s before the death); the `extend` pair is sent with that "
        "traffic held (its crash needs the pair alone in the batch).")
    fig.write(results, body, summary)
    return 0


if __name__ == "__main__":
    run_main(main)
