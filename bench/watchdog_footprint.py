"""Figure 6: the watchdog's own footprint (RSS and CPU) while it watches.

The daemon watches tiny fake servers that answer like mlx_lm.server (a good
one-token chat completion, /health 200), all in one helper process, so that
the numbers measure the watchdog alone. Cases, each at the DEFAULT probe
interval (5 s) and timeout:

  watch x1     `mlx-watchdog watch --config C` with 1 instance
  watch x10    the same with 10 instances (10 monitor threads)
  supervise    `mlx-watchdog supervise -- <fake server>`: the supervisor
               process only, not its child (it also scans the child's CPU)
  baseline     a bare `python -c "import time; time.sleep(...)"` of the same
               interpreter, measured the same way: the floor any Python
               daemon pays

Each runs with `--log-format json --state-file <tmp>`, and is measured after
it has judged every instance healthy and settled for a probe cycle: RSS
sampled every second over the window (60 s, 15 s in --quick), CPU as the
process's user+system time over the window divided by the wall time (in %
of one core), plus the probes the fakes saw (to check the interval). USS
(memory only this process holds) is read once at the end. Goals: RSS <= 40
MB and CPU <= 0.5% of a core.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil

from common import (
    CLEANUP,
    ROOT,
    Figure,
    fmt,
    kill_group,
    main_python,
    run_main,
    stats,
    table,
    temp_dir,
)
from tests.support.server import base_env, free_port

GOAL_RSS_MB = 40.0
GOAL_CPU_PCT = 0.5
SETTLE_S = 6.0  # one default probe cycle after every instance is healthy

# The helper process: N fake servers (tests/fakeserver.py), one line of JSON
# with their ports on stdout, then it serves until killed. Every request is
# counted; `kill -USR1` makes it print the counts.
FAKES = r"""
import json, signal, sys, threading, time
sys.path.insert(0, sys.argv[2])
from tests.fakeserver import FakeServer
fakes = [FakeServer().__enter__() for _ in range(int(sys.argv[1]))]
print(json.dumps([f.port for f in fakes]), flush=True)
def report(*_):
    print(json.dumps([len(f.requests) for f in fakes]), flush=True)
signal.signal(signal.SIGUSR1, report)
while True:
    time.sleep(3600)
"""


class Fakes:
    def __init__(self, n: int):
        self.proc = subprocess.Popen([str(main_python()), "-c", FAKES, str(n), str(ROOT)],
                                     stdout=subprocess.PIPE, text=True,
                                     env=base_env(shim=False), start_new_session=True)
        CLEANUP.add(self.proc)
        self.ports: List[int] = json.loads(self.proc.stdout.readline())

    def requests(self) -> List[int]:
        self.proc.send_signal(signal.SIGUSR1)
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        kill_group(self.proc)
        CLEANUP.discard(self.proc)


def start(argv: List[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as handle:
        proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=base_env(shim=False),
                                start_new_session=True)
    CLEANUP.add(proc)
    return proc


def all_healthy(state: Path, names: List[str]) -> bool:
    try:
        instances = json.loads(state.read_text())["instances"]
    except (OSError, ValueError, KeyError):
        return False
    return all(instances.get(n, {}).get("state") == "healthy" for n in names)


def measure(proc: subprocess.Popen, window: float) -> Dict:
    """RSS every second and CPU over the window, of proc alone (not its children)."""
    p = psutil.Process(proc.pid)
    rss: List[float] = []
    t0, c0 = time.monotonic(), sum(p.cpu_times()[:2])
    while time.monotonic() - t0 < window:
        rss.append(p.memory_info().rss / 2**20)
        time.sleep(1.0)
    cpu_s = sum(p.cpu_times()[:2]) - c0
    wall = time.monotonic() - t0
    try:
        uss = p.memory_full_info().uss / 2**20
    except psutil.Error:
        uss = None
    return {"rss_mb": stats(rss), "rss_samples_mb": rss, "cpu_s": cpu_s, "wall_s": wall,
            "cpu_pct": 100.0 * cpu_s / wall, "uss_mb": uss, "threads": p.num_threads()}


def run_case(fig: Figure, work: Path, case: str, window: float) -> Dict:
    state = work / f"state-{case}.json"
    log = work / f"{case}.log"
    fakes: Optional[Fakes] = None
    child = None
    names: List[str] = []
    if case == "baseline":
        argv = [str(main_python()), "-c", "import time; time.sleep(100000)"]
    elif case.startswith("watch"):
        n = int(case.split("x")[1])
        fakes = Fakes(n)
        names = [f"fake{i}" for i in range(n)]
        config = work / f"{case}.toml"
        config.write_text("".join(
            f'[instances.{name}]\nurl = "http://127.0.0.1:{port}"\n'
            f'restart = {{ type = "command", argv = ["true"] }}\n\n'
            for name, port in zip(names, fakes.ports)))
        argv = [str(main_python()), "-m", "mlx_watchdog", "watch", "--config", str(config),
                "--log-format", "json", "--state-file", str(state)]
    else:  # supervise a fake server (its own process, not measured)
        port = free_port()
        names = [f"127.0.0.1:{port}"]
        argv = [str(main_python()), "-m", "mlx_watchdog", "supervise", "--no-shim",
                "--log-format", "json", "--state-file", str(state), "--",
                str(main_python()), str(ROOT / "tests" / "fakeserver.py"), "--port", str(port),
                "--starts", str(work / "starts")]
    proc = start(argv, log)
    try:
        if names:
            deadline = time.monotonic() + 120
            while not all_healthy(state, names):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{case}: not all healthy:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
        time.sleep(SETTLE_S)
        if case == "supervise":
            child = next(iter(psutil.Process(proc.pid).children()), None)
        before = fakes.requests() if fakes else None
        result = measure(proc, window)
        if fakes:
            after = fakes.requests()
            result["probes"] = sum(after) - sum(before)
            result["probes_expected"] = len(names) * result["wall_s"] / 5.0
        result["instances"] = len(names)
        result["alive_after"] = proc.poll() is None
        fig.log(f"  {case}: RSS median {result['rss_mb']['median']:.1f} MB "
                f"(max {result['rss_mb']['max']:.1f}), CPU {result['cpu_pct']:.3f}% of a core, "
                f"{result.get('probes', '-')} probes")
        return result
    finally:
        kill_group(proc, signal.SIGTERM)  # a supervisor stops its child on SIGTERM
        kill_group(proc)
        CLEANUP.discard(proc)
        if child is not None:
            try:
                if child.is_running():  # psutil: also checks the pid was not reused
                    os.killpg(child.pid, signal.SIGKILL)
            except (psutil.Error, OSError):
                pass
        if fakes:
            fakes.stop()


def main() -> int:
    fig = Figure("watchdog_footprint", "Figure 6: the watchdog's footprint", __doc__)
    window = 15.0 if fig.quick else 60.0
    work = temp_dir("bench-footprint-")
    cases = ("baseline", "watch-x1", "watch-x10", "supervise")
    results = {"window_s": window, "cases": {}}
    for case in cases:
        fig.log(f"{case}: {window:g} s")
        results["cases"][case] = run_case(fig, work, case, window)

    labels = {"baseline": "bare `python -c 'import time; time.sleep()'` (floor)",
              "watch-x1": "`mlx-watchdog watch`, 1 instance",
              "watch-x10": "`mlx-watchdog watch`, 10 instances",
              "supervise": "`mlx-watchdog supervise`, 1 child (supervisor only)"}
    rows, summary = [], {}
    base = results["cases"]["baseline"]["rss_mb"]["median"]
    worst_rss = worst_cpu = 0.0
    for case in cases:
        r = results["cases"][case]
        rss = r["rss_mb"]
        over = "" if case == "baseline" else f" (+{rss['median'] - base:.1f})"
        probes = (f"{r['probes']} / {r['probes_expected']:.0f}" if "probes" in r else "–")
        rows.append([labels[case], f"**{fmt(rss['median'], ' MB', 1)}**{over}",
                     fmt(rss["max"], " MB", 1), fmt(r["uss_mb"], " MB", 1),
                     f"**{r['cpu_pct']:.3f}%**", r["threads"], probes])
        if case != "baseline":
            worst_rss = max(worst_rss, rss["max"])
            worst_cpu = max(worst_cpu, r["cpu_pct"])
        summary[f"{case}_rss_median_mb"] = rss["median"]
        summary[f"{case}_cpu_pct"] = r["cpu_pct"]
    summary["worst_rss_mb"] = worst_rss
    summary["worst_cpu_pct"] = worst_cpu
    summary["meets_rss_goal"] = worst_rss <= GOAL_RSS_MB
    summary["meets_cpu_goal"] = worst_cpu <= GOAL_CPU_PCT
    met = {k: "met" if summary[f"meets_{k}_goal"] else "not met" for k in ("rss", "cpu")}
    body = (f"Goals: RSS ≤ {GOAL_RSS_MB:g} MB (**{met['rss']}**, worst {worst_rss:.1f} MB) and "
            f"CPU ≤ {GOAL_CPU_PCT:g}% of a core (**{met['cpu']}**, worst {worst_cpu:.3f}%), "
            f"at the default 5 s probe interval, over {window:g} s.\n\n")
    body += table(["process", "RSS median (vs floor)", "RSS max", "USS", "CPU, % of one core",
                   "threads", "probes seen / expected"], rows)
    body += ("\n\nThe fake servers (tests/fakeserver.py, a good one-token completion each) run "
             "in a separate helper process, so only the watchdog is measured; the supervised "
             "child is a fake server too and is not counted. RSS sampled every second after "
             "every instance was healthy and one more probe cycle; CPU is user+system time "
             "over the window. Both daemons ran with `--log-format json --state-file <tmp>` "
             "and no other flag (watch: a `command` restart action, never used).")
    fig.write(results, body, summary)
    return 0


if __name__ == "__main__":
    run_main(main)
