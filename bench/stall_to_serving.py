"""Figure 7: a livelock, and a hang at boot, to serving again; this revision
side by side with today's (the baseline revision), in one run.

Both on a real stock mlx_lm.server 0.32.2 (tiny random llama, CPU), under
`mlx-watchdog supervise` with default settings (only `--log-format json
--state-file <tmp>` added):

  livelock     `MLX_TEST_FAULT=livelock:batch` (harness/faults):
               `BatchGenerator.next` returns no responses, forever, from one
               ordinary request on (upstream #1493). The loop keeps turning;
               nothing is delivered. MLX_HOTFIX_STALL_TIMEOUT=10 for both
               sides (the tiny model's steps take milliseconds; the shipped
               default is 300 s, see docs/operator.md); the baseline's shim ignores
               it.
  hang at boot `MLX_TEST_FAULT=hang:prefill`, armed before the start: the
               first real request after start-up (the watchdog's own first
               probe) blocks its prefill forever at 0% CPU. Disarmed as soon
               as it struck, so the restarted server serves.

"This revision" runs the watchdog and shim of this checkout. "Today" runs
the watchdog and shim of the baseline revision (default: the merge base
with `main`; on main, the last release v0.2), extracted with `git archive` into a temporary folder and put
first on PYTHONPATH, so nothing in the checkout changes. Fault moment: the
`t=` the injector writes. Serving again: the first one-token completion
answered 200, polled every 0.1 s. A side that has not served again by the
cap is reported as "> cap" (today's livelock is restarted only by
`--max-busy`, 600 s by default).
"""

from __future__ import annotations

import io
import re
import subprocess
import tarfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional


from bench.common import (
    FAULTS_DIR,
    Figure,
    build_model,
    fmt,
    main_python,
    run_main,
    stats,
    table,
    temp_dir,
)
from bench.hang_to_serving import (
    LOAD_S,
    server_args,
    track_children,
    wait_event,
    wait_serving,
)
from bench.procs import TimedProcess, TimedServer
from bench.timeline import LEAD_S, Traffic
from harness.procs import chat
from harness.server import base_env, free_port

REPO = Path(__file__).resolve().parents[1]
FAULT_LINE = re.compile(r"mlx-test-fault: (\w+) at (\w+) t=([0-9.]+)")
STALL_S = "10"
AFTER_SERVING_S = 5.0  # traffic kept after serving again, for the timeline


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


# The last release (v0.2): what "today" means once a branch is merged, when
# the merge base with main is the head itself.
LAST_RELEASE = "b2048a3"


def default_baseline() -> str:
    """The revision that stands for today: the merge base with main, or, on
    main itself (nothing to compare with there), the last release."""
    try:
        base = git("merge-base", "HEAD", "main")
    except subprocess.CalledProcessError:
        return LAST_RELEASE
    return LAST_RELEASE if base == git("rev-parse", "HEAD") else base


def extract_baseline(revision: str, into: Path) -> Path:
    """watchdog/ and sitecustomize/ of revision, in into/; returns into."""
    data = subprocess.run(["git", "-C", str(REPO), "archive", revision, "watchdog",
                           "sitecustomize"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(into)
    # Its watchdog must find its own shim, not the editable install's drop-in.
    (into / "watchdog" / "mlx_watchdog" / "dropin").symlink_to(Path("..", "..", "sitecustomize"))
    return into


def supervise(work: Path, name: str, port: int, model: Path, env: dict,
              baseline: Optional[Path]) -> TimedProcess:
    argv = [str(main_python()), "-m", "mlx_watchdog", "supervise", "--log-format", "json",
            "--state-file", str(work / f"state-{name}.json"), "--", *server_args(model, port)]
    extra = dict(env)
    if baseline is not None:  # the baseline watchdog (and so its shim) comes first
        extra["PYTHONPATH"] = str(baseline / "watchdog") + ":" + extra.get("PYTHONPATH", "")
    return TimedProcess(argv, base_env(shim=False, extra=extra), work / f"{name}.log")


def one_run(fig: Figure, scenario: str, side: str, model: Path, work: Path,
            baseline: Optional[Path], cap_s: float, n: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    arm = work / f"arm-{scenario}-{side}-{n}"
    fault = "livelock:batch" if scenario == "livelock" else "hang:prefill"
    env = {"PYTHONPATH": str(FAULTS_DIR), "MLX_TEST_FAULT": fault,
           "MLX_TEST_FAULT_ARM_FILE": str(arm), "MLX_HOTFIX_STALL_TIMEOUT": STALL_S}
    if scenario == "hang-at-boot":
        arm.touch()
    sup = supervise(work, f"{scenario}-{side}-{n}", port, model, env, baseline)
    seen: set = set()
    traffic = None
    try:
        if scenario == "livelock":
            if wait_serving(url, time.time() + LOAD_S) is None:
                raise RuntimeError(f"never served:\n{sup.out.text()[-3000:]}")
            if wait_event(sup.out, lambda e: e.get("state") == "healthy", 0, 120) is None:
                raise RuntimeError(f"never healthy:\n{sup.out.text()[-3000:]}")
            if n == 0:  # the first livelock of each side carries traffic, for the plot
                traffic = Traffic(url).start()
                time.sleep(LEAD_S)
            arm.touch()
            threading.Thread(target=_quiet_chat, args=(url,), daemon=True).start()
        hit = sup.out.wait_line(FAULT_LINE, LOAD_S)
        arm.unlink()
        if hit is None:
            raise RuntimeError(f"the fault never struck:\n{sup.out.text()[-3000:]}")
        fault_at = float(hit[2].group(3))
        track_children(sup, seen)
        serving_at = wait_serving(url, fault_at + cap_s)
        restart = wait_event(sup.out, lambda e: e.get("event") == "restart", 0, 1)
        track_children(sup, seen)
        record = {
            "fault_at": fault_at,
            "fault_to_restart_s": (restart[1] - fault_at) if restart else None,
            "cause": restart[2].get("cause") if restart else None,
            "fault_to_serving_s": (serving_at - fault_at) if serving_at else None,
            "cap_s": cap_s,
        }
        if traffic is not None:
            time.sleep(max(0.0, (serving_at or time.time()) + AFTER_SERVING_S - time.time()))
            traffic.stop()
            record["timeline"] = traffic.timeline(fault_at, [
                (restart[1] if restart else None, "restart decided"),
                (serving_at, "serving again")])
        fig.log(f"  {scenario} / {side} #{n}: restart "
                f"{fmt(record['fault_to_restart_s'], ' s', 1)} ({record['cause']}), serving "
                f"{fmt(record['fault_to_serving_s'], ' s', 1) if serving_at else f'> {cap_s:g} s'}")
        return record
    finally:
        if traffic is not None:
            traffic.stop()
        sup.stop()


def stock_livelock(fig: Figure, model: Path, work: Path, window_s: float) -> dict:
    """A stock server (no shim, no watchdog) in the same livelock, under the same
    traffic, watched for window_s: the plot's baseline."""
    arm = work / "arm-livelock-stock"
    env = {"PYTHONPATH": str(FAULTS_DIR), "MLX_TEST_FAULT": "livelock:batch",
           "MLX_TEST_FAULT_ARM_FILE": str(arm)}
    server = TimedServer("0.32.2", model, work, shim=False, env=env).start()
    traffic = None
    try:
        server.wait_listening(LOAD_S)
        if wait_serving(server.url, time.time() + LOAD_S) is None:
            raise RuntimeError(f"the stock server never served:\n{server.log()[-3000:]}")
        traffic = Traffic(server.url).start()
        time.sleep(LEAD_S)
        arm.touch()
        threading.Thread(target=_quiet_chat, args=(server.url,), daemon=True).start()
        hit = server.out.wait_line(FAULT_LINE, 120)
        if hit is None:
            raise RuntimeError(f"the fault never struck:\n{server.log()[-3000:]}")
        fault_at = float(hit[2].group(3))
        time.sleep(max(0.0, fault_at + window_s - time.time()))
        traffic.stop()
        fig.log(f"  livelock / stock: watched {window_s:g} s")
        return {"fault_at": fault_at, "window_s": window_s,
                "timeline": traffic.timeline(fault_at)}
    finally:
        if traffic is not None:
            traffic.stop()
        server.stop()


def _quiet_chat(url: str) -> None:
    try:
        chat(url, "this one livelocks", max_tokens=50, timeout=60)
    except Exception:  # noqa: BLE001 - it is expected to fail
        pass


def main() -> int:
    fig = Figure("stall_to_serving", "Figure 7: livelock and hang at boot to serving again",
                 __doc__, add_arguments=lambda p: p.add_argument(
                     "--baseline", default=None,
                     help="the revision that stands for today [default: the merge base with "
                          "main; on main, the last release, v0.2]"))
    reps = 1 if fig.quick else 3
    cap = {"livelock": 120.0 if fig.quick else 660.0, "hang-at-boot": 180.0}
    head = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--", "watchdog", "sitecustomize"))
    base_rev = fig.args.baseline or default_baseline()
    base_short = git("rev-parse", "--short", base_rev)
    work = temp_dir("bench-stall-")
    baseline = extract_baseline(base_rev, work / "baseline")
    model = build_model("llama", work / "llama")

    results: Dict[str, Dict[str, List[dict]]] = {}
    for scenario in ("livelock", "hang-at-boot"):
        results[scenario] = {"this": [], "today": []}
        for n in range(reps):
            order = ("this", "today") if n % 2 == 0 else ("today", "this")
            for side in order:
                results[scenario][side].append(one_run(
                    fig, scenario, side, model, work, None if side == "this" else baseline,
                    cap[scenario], n))

    stock = stock_livelock(fig, model, work, 30.0 if fig.quick else 60.0)
    arms = {"stock": stock["timeline"]}
    for side, label in (("today", f"today ({base_short})"), ("this", "this revision")):
        arms[label] = next((r["timeline"] for r in results["livelock"][side]
                            if r.get("timeline")), None)
    timelines = {} if None in arms.values() else {"livelock": {
        "title": "a livelocked generation loop, mlx-lm 0.32.2: requests answered per second",
        "zero": "livelock", "arms": arms}}

    rows, summary = [], {}
    for scenario, sides in results.items():
        for side, label in (("this", f"this revision ({head}{'+dirty' if dirty else ''})"),
                            ("today", f"today ({base_short})")):
            runs = sides[side]
            serve = stats([r["fault_to_serving_s"] for r in runs
                           if r["fault_to_serving_s"] is not None])
            causes = sorted({r["cause"] for r in runs if r["cause"]}) or ["none"]
            missed = sum(r["fault_to_serving_s"] is None for r in runs)
            shown = f"**{fmt(serve['median'], ' s', 1)}** / {fmt(serve['max'], ' s', 1)}" \
                if serve["n"] else "n/a"
            if missed:
                shown += f"; {missed} not serving by {cap[scenario]:g} s"
            rows.append([scenario, label, f"{serve['n']}/{len(runs)}", shown,
                         ", ".join(causes)])
            summary[f"{scenario}_{side}_median_s"] = serve["median"]
            summary[f"{scenario}_{side}_not_serving_by_cap"] = missed
    summary.update({"revision": head, "dirty": dirty, "baseline": base_short})
    body = table(["scenario", "watchdog + shim", "served again", "fault → serving (median / max)",
                  "restart cause"], rows)
    body += (f"\n\n{reps} run(s) per cell, sides alternated. Livelock: "
             "`MLX_TEST_FAULT=livelock:batch`, struck by one request once healthy; "
             f"`MLX_HOTFIX_STALL_TIMEOUT={STALL_S}`. Hang at boot: `MLX_TEST_FAULT=hang:prefill` "
             "armed before start-up; the watchdog's first probe strikes it. Both: "
             "`mlx-watchdog supervise` defaults on stock mlx-lm 0.32.2, tiny random llama, CPU. "
             f"Today = watchdog and shim of {base_short} (git archive), same run. Plot: the "
             "first livelock of each side, and a stock server (no shim, no watchdog) in the "
             f"same livelock watched for {stock['window_s']:g} s, under steady traffic "
             "(bench/timeline.py: 2 clients, one 4-token completion after another, 10 s read "
             f"timeout, from {LEAD_S:g} s before the livelock).")
    fig.write({"results": results, "revision": head, "dirty": dirty, "baseline": base_rev,
               "caps_s": cap, "stock": stock, "timelines": timelines}, body, summary)
    return 0


if __name__ == "__main__":
    run_main(main)
