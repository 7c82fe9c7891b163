"""Chaos soak: a supervised server under steady load, a fault every 35-65 s.

A real stock mlx_lm.server 0.32.2 (tiny random llama, CPU) with the hotfix
shim, run by `mlx-watchdog supervise` with default settings (only
`--log-format json --state-file <tmp>` added). While it runs:

  load     4 clients, each sending one chat completion after another
           (16-48 tokens, every other one streamed), 120 s client timeout;
  faults   every 35-65 s (uniform, seeded) one fault: a death (an exception
           out of `BatchGenerator.next`), a hang (the loop blocks there at 0%
           CPU) or a livelock (the loop turns and delivers nothing, upstream
           #1493), each once per round of three in a seeded random order,
           injected through harness/faults
           (`MLX_TEST_FAULT=chaos:batch`: the next step after the arming
           strikes). MLX_HOTFIX_STALL_TIMEOUT=10 (the tiny model's steps take
           milliseconds; the shipped default is 300 s), as in figure 7.

Availability: the share of time a normal client's request is served. A
sampler sends a one-token completion every 0.5 s, whatever happened to the
previous one; a sample is served when it gets a 200 with a choice within
30 s. The 4 clients' requests are counted by outcome: completed (200, whole
answer), answered with an error (an HTTP status other than 200, or a stream
that ended with an error event: the client was told), refused (no connection:
nothing was sent), lost (sent, and the connection closed with no answer, or a
200 stream cut off with neither [DONE] nor an error event), hung (no answer
within the 120 s timeout).

"This revision" runs this checkout's watchdog and shim, as they are. "Today"
(the baseline revision, by default the merge base with `main`, on main the
last release v0.2), or any
revision named in `--sides`, runs that revision's watchdog and shim from a
`git archive` (as figure 7 does), so edits made while it runs do not reach
it. Every side gets the same seed, so the same fault schedule. `--mode recover` sets
MLX_HOTFIX_RECOVER=thread (a death is recovered in place). Goal: exit mode
available >= 90% of the time.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from bench.common import (
    FAULTS_DIR,
    Figure,
    build_model,
    fmt,
    run_main,
    stats,
    table,
    temp_dir,
)
from bench.hang_to_serving import LOAD_S, events, track_children, wait_event, wait_serving
from bench.stall_to_serving import STALL_S, default_baseline, extract_baseline, git, supervise
from harness.procs import chat_body

FAULT_LINE = re.compile(r"mlx-test-fault: (\w+) at (\w+) t=([0-9.]+)")
FAULTS = {"death": "raise:typeerror", "hang": "hang", "livelock": "livelock"}
CLIENTS = 4
CLIENT_TIMEOUT_S = 120.0
SAMPLE_EVERY_S = 0.5
SAMPLE_TIMEOUT_S = 30.0
GAP_S = (35.0, 65.0)
GOAL = 0.90

COMPLETED, ANSWERED, REFUSED, LOST, HUNG = "completed", "answered_error", "refused", "lost", "hung"


def request(port: int, payload: dict, timeout: float) -> Tuple[str, Optional[int]]:
    """One chat completion over http.client; its outcome (see the docstring)
    and HTTP status."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        try:
            conn.connect()
        except OSError:
            return REFUSED, None
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(payload),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            body = response.read()
        except (socket.timeout, TimeoutError):
            return HUNG, None
        except (OSError, http.client.HTTPException):
            return LOST, None
        if response.status != 200:
            return ANSWERED, response.status
        return _outcome_200(body, bool(payload.get("stream"))), 200
    finally:
        conn.close()


def _outcome_200(body: bytes, stream: bool) -> str:
    if stream:
        events = [line[5:].strip() for line in body.decode(errors="replace").splitlines()
                  if line.startswith("data:")]
        if events and events[-1] == "[DONE]":
            return COMPLETED
        if events and '"error"' in events[-1]:
            return ANSWERED
        return LOST
    try:
        data = json.loads(body)
    except ValueError:
        return LOST
    return COMPLETED if isinstance(data, dict) and data.get("choices") else ANSWERED


class Load:
    """The 4 clients and the availability sampler, until stop()."""

    def __init__(self, port: int, seed: int):
        self.port = port
        self.stopping = threading.Event()
        self.outcomes: List[dict] = []
        self.samples: List[dict] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i, seed), daemon=True)
                         for i in range(CLIENTS)]
        self._threads.append(threading.Thread(target=self._sampler, daemon=True))
        self._samplers: List[threading.Thread] = []

    def start(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        for thread in self._threads + self._samplers:
            thread.join(CLIENT_TIMEOUT_S + 10)

    def _client(self, index: int, seed: int) -> None:
        rng = random.Random(seed * 100 + index)
        n = 0
        while not self.stopping.is_set():
            n += 1
            stream = n % 2 == 0
            payload = chat_body(f"client {index} request {n}: tell me a story",
                                max_tokens=rng.randint(16, 48), stream=stream)
            sent = time.time()
            outcome, status = request(self.port, payload, CLIENT_TIMEOUT_S)
            with self._lock:
                self.outcomes.append({"client": index, "sent_at": sent, "stream": stream,
                                      "outcome": outcome, "status": status,
                                      "finished_at": time.time()})
            if outcome in (REFUSED, ANSWERED):
                time.sleep(0.2)  # refused or turned away: do not spin

    def _sampler(self) -> None:
        next_at = time.time()
        while not self.stopping.is_set():
            thread = threading.Thread(target=self._sample, args=(time.time(),), daemon=True)
            thread.start()
            self._samplers.append(thread)
            next_at += SAMPLE_EVERY_S
            self.stopping.wait(max(0.0, next_at - time.time()))

    def _sample(self, sent: float) -> None:
        outcome, status = request(self.port, chat_body("are you there", max_tokens=1),
                                  SAMPLE_TIMEOUT_S)
        with self._lock:
            self.samples.append({"sent_at": sent, "served": outcome == COMPLETED,
                                 "outcome": outcome, "status": status})


def soak(fig: Figure, side: str, model: Path, work: Path, baseline: Optional[Path],
         minutes: float, mode: str, seed: int, log_dir: Optional[Path]) -> dict:
    from harness.server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    arm = work / f"arm-{side}"
    env = {"PYTHONPATH": str(FAULTS_DIR), "MLX_TEST_FAULT": "chaos:batch",
           "MLX_TEST_FAULT_ARM_FILE": str(arm), "MLX_HOTFIX_STALL_TIMEOUT": STALL_S,
           "MLX_HOTFIX_REPORT_DIR": str(work / f"reports-{side}")}
    if mode == "recover":
        env["MLX_HOTFIX_RECOVER"] = "thread"
    sup = supervise(log_dir or work, f"soak-{side}", port, model, env, baseline)
    seen: set = set()
    rng = random.Random(seed)
    armed: List[dict] = []
    bag: List[str] = []
    try:
        if wait_serving(url, time.time() + LOAD_S) is None:
            raise RuntimeError(f"never served:\n{sup.out.text()[-3000:]}")
        if wait_event(sup.out, lambda e: e.get("state") == "healthy", 0, 120) is None:
            raise RuntimeError(f"never healthy:\n{sup.out.text()[-3000:]}")
        started = time.time()
        ends = started + minutes * 60
        load = Load(port, seed).start()
        next_fault = started + rng.uniform(*GAP_S)
        while time.time() < ends:
            track_children(sup, seen)
            if time.time() >= next_fault:
                if not bag:  # each kind once per round, in a random order
                    bag = rng.sample(sorted(FAULTS), len(FAULTS))
                kind = bag.pop()
                tmp = arm.with_suffix(".tmp")
                tmp.write_text(FAULTS[kind] + "\n")
                tmp.replace(arm)  # whole: the injector never reads half a line
                armed.append({"kind": kind, "armed_at": time.time()})
                fig.log(f"  {side}: {kind} armed at +{time.time() - started:.0f} s")
                next_fault += rng.uniform(*GAP_S)
            time.sleep(0.2)
        arm.unlink(missing_ok=True)
        load.stop()
        track_children(sup, seen)
        return summarize(side, sup, load, armed, started, ends)
    finally:
        arm.unlink(missing_ok=True)
        sup.stop()


def summarize(side: str, sup, load: Load, armed: List[dict], started: float,
              ends: float) -> dict:
    struck = [(float(m.group(3)), m.group(1)) for _, text in sup.out.lines
              if (m := FAULT_LINE.search(text))]
    samples = sorted((s for s in load.samples if started <= s["sent_at"] < ends),
                     key=lambda s: s["sent_at"])
    served = sum(s["served"] for s in samples)
    counts: Dict[str, int] = {k: 0 for k in (COMPLETED, ANSWERED, REFUSED, LOST, HUNG)}
    statuses: Dict[str, int] = {}
    for o in load.outcomes:
        counts[o["outcome"]] += 1
        if o["outcome"] == ANSWERED:
            statuses[str(o["status"])] = statuses.get(str(o["status"]), 0) + 1
    restarts = [e for _, _, e in events(sup.out) if e.get("event") == "restart"]
    # Per fault: from the strike to the first served sample sent after it.
    downtimes = []
    for at, _ in struck:
        back = next((s["sent_at"] for s in samples if s["sent_at"] > at and s["served"]), None)
        downtimes.append(None if back is None else back - at)
    return {
        "side": side,
        "availability": served / len(samples) if samples else None,
        "samples": len(samples),
        "served_samples": served,
        "requests": counts,
        "error_statuses": statuses,
        "faults_armed": [a["kind"] for a in armed],
        "faults_struck": [kind for _, kind in struck],
        "fault_to_served_s": downtimes,
        "restarts": len(restarts),
        "restart_causes": [e.get("cause") for e in restarts],
        "crash_looping_restarts": sum(e.get("state") == "crash-looping" for e in restarts),
        "backoff_waits": sum(1 for _, _, e in events(sup.out)
                             if "backoff" in str(e.get("message", ""))),
        "duration_s": ends - started,
    }


def main() -> int:
    def arguments(parser) -> None:
        parser.add_argument("--minutes", type=float, default=None,
                            help="soak length per side [default: 10, 2 with --quick]")
        parser.add_argument("--mode", choices=("exit", "recover"), default="exit",
                            help="the shim on a death: exit (default) or recover in place")
        parser.add_argument("--sides", default="this,today",
                            help="which watchdogs to soak, in order, comma-separated: this "
                                 "(the checkout as it is), today (the baseline) or a git "
                                 "revision [default: this,today]")
        parser.add_argument("--baseline", default=None,
                            help="the revision that stands for today "
                                 "[default: the merge base with main; on main, the "
                                 "last release, v0.2]")
        parser.add_argument("--seed", type=int, default=1, help="fault schedule and load seed")
        parser.add_argument("--log-dir", type=Path, default=None,
                            help="keep the supervisors' logs and state files there "
                                 "[default: a temporary folder, removed]")

    fig = Figure("chaos_soak", "Chaos soak: availability under a fault every 35-65 s",
                 __doc__, add_arguments=arguments)
    minutes = fig.args.minutes or (2.0 if fig.quick else 10.0)
    sides = [s.strip() for s in fig.args.sides.split(",") if s.strip()]
    if not sides:
        raise SystemExit("--sides: this, today or git revisions, comma-separated")
    head = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--", "watchdog", "sitecustomize"))
    base_rev = fig.args.baseline or default_baseline()
    base_short = git("rev-parse", "--short", base_rev)
    work = temp_dir("bench-chaos-")
    if fig.args.log_dir is not None:
        fig.args.log_dir.mkdir(parents=True, exist_ok=True)
    revisions: Dict[str, Optional[str]] = {}  # side -> the revision archived (None: checkout)
    labels: Dict[str, str] = {}
    for side in sides:
        if side == "this":
            revisions[side] = None
            labels[side] = f"this revision ({head}{'+dirty' if dirty else ''})"
        else:
            revision = base_rev if side == "today" else side
            try:
                short = git("rev-parse", "--short", revision)
            except subprocess.CalledProcessError:
                raise SystemExit(f"--sides: {side!r} is not a git revision") from None
            revisions[side] = revision
            labels[side] = f"today ({short})" if side == "today" else f"revision {short}"
    model = build_model("llama", work / "llama")

    results = {}
    for side in sides:
        archived = None
        if revisions[side] is not None:
            archived = extract_baseline(revisions[side], work / f"archive-{len(results)}")
        fig.log(f"soak {side} ({minutes:g} min, {fig.args.mode} mode, seed {fig.args.seed})")
        results[side] = soak(fig, side, model, work, archived, minutes, fig.args.mode,
                             fig.args.seed, fig.args.log_dir)
        r = results[side]
        fig.log(f"  {side}: available {fmt(r['availability'] * 100, ' %', 1)}, "
                f"{r['requests']}, {r['restarts']} restarts")

    rows, summary = [], {"mode": fig.args.mode, "minutes_per_side": minutes,
                         "seed": fig.args.seed, "revision": head, "dirty": dirty,
                         "baseline": base_short, "goal_availability": GOAL}
    for side, r in results.items():
        counts = r["requests"]
        side_key = re.sub(r"\W", "_", side)
        down = stats([d for d in r["fault_to_served_s"] if d is not None])
        rows.append([
            labels[side], f"**{fmt(r['availability'] * 100, ' %', 1)}**",
            _fault_mix(r["faults_struck"]),
            f"{fmt(down['median'], ' s', 1)} / {fmt(down['max'], ' s', 1)}",
            r["restarts"], counts[COMPLETED], counts[ANSWERED], counts[REFUSED],
            counts[LOST], counts[HUNG]])
        summary[f"{side_key}_availability"] = r["availability"]
        summary[f"{side_key}_lost"] = counts[LOST]
        summary[f"{side_key}_hung"] = counts[HUNG]
        if fig.args.mode == "exit":
            summary[f"{side_key}_goal_met"] = (r["availability"] or 0) >= GOAL
    body = table(["watchdog + shim", "available", "faults struck",
                  "fault → served (median / max)", "restarts", "completed",
                  "answered error", "refused", "lost", "hung"], rows)
    body += (f"\n\n{minutes:g} min per side, {fig.args.mode} mode, seed {fig.args.seed} (the "
             "same fault schedule for both sides). `mlx-watchdog supervise` defaults on stock "
             f"mlx-lm 0.32.2 with the shim, tiny random llama, CPU; {CLIENTS} clients in a loop "
             f"(16-48 tokens, every other one streamed, {CLIENT_TIMEOUT_S:g} s timeout); a death, "
             "hang or livelock (`MLX_TEST_FAULT=chaos:batch`) every 35-65 s; "
             f"`MLX_HOTFIX_STALL_TIMEOUT={STALL_S}`. Available: the share of one-token "
             f"completions sent every {SAMPLE_EVERY_S:g} s that got a 200 within "
             f"{SAMPLE_TIMEOUT_S:g} s. Lost: sent, and closed with no answer (or a stream cut "
             f"off with no [DONE] nor error event); hung: no answer in {CLIENT_TIMEOUT_S:g} s. "
             f"Goal: exit mode available >= {GOAL:.0%}. A side named by a revision runs the "
             "watchdog and shim of that revision (git archive), in the same run.")
    fig.write({"sides": results, "labels": labels, "revisions": revisions, "revision": head,
               "dirty": dirty, "baseline": base_rev}, body, summary)
    return 0


def _fault_mix(struck: List[str]) -> str:
    names = {"raise": "death", "hang": "hang", "livelock": "livelock"}
    mix = ", ".join(f"{struck.count(k)} {name}" for k, name in names.items() if struck.count(k))
    return f"{len(struck)} ({mix})" if struck else "0"


if __name__ == "__main__":
    run_main(main)
