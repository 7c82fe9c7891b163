"""Figure 3: start-up cost of the drop-in on an unrelated `python -c pass`.

For each tested venv, runs `python -c pass` in rounds; each round runs the
three variants once, in a shuffled order:

    stock   no PYTHONPATH
    shim    PYTHONPATH=<repo>/sitecustomize
    off     PYTHONPATH=<repo>/sitecustomize MLX_HOTFIX=0

and times each run from spawn to reaped exit (the same fork/exec/wait work in
every variant, so it cancels in the differences). Reported: the medians of
each variant and the median (and p90) of the per-round differences
shim - stock and off - stock. Goal: shim - stock <= 3 ms.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    SHIM_DIR,
    VERSIONS,
    Figure,
    env_python,
    fmt,
    run_main,
    stats,
    table,
)
from tests.support.server import base_env

GOAL_MS = 3.0
VARIANTS = ("stock", "shim", "off")


def variant_env(variant: str) -> dict:
    env = base_env(shim=False)
    if variant in ("shim", "off"):
        env["PYTHONPATH"] = str(SHIM_DIR)
    if variant == "off":
        env["MLX_HOTFIX"] = "0"
    return env


def time_once(python: str, env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen([python, "-c", "pass"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = proc.communicate()
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0 or err:
        raise RuntimeError(f"`{python} -c pass` failed ({proc.returncode}): {err[-500:]!r}")
    return elapsed


SANITY = ("import sys; m = sys.modules.get('sitecustomize'); "
          "print(getattr(m, '__file__', None), any(type(f).__name__ == '_MlxLmImportTrigger' "
          "for f in sys.meta_path), 'mlx_hotfix' in sys.modules)")


def sanity(python: str) -> dict:
    """What each variant loads: the sitecustomize file, the trigger, mlx_hotfix."""
    out = {}
    for variant in VARIANTS:
        result = subprocess.run([python, "-c", SANITY], env=variant_env(variant),
                                capture_output=True, text=True, timeout=60)
        out[variant] = (result.stdout.strip() + result.stderr.strip())
    return out


def main() -> int:
    fig = Figure("startup_cost", "Figure 3: start-up cost of the drop-in on `python -c pass`",
                 __doc__)
    rounds = 30 if fig.quick else 200
    warmup = 5 if fig.quick else 20
    rng = random.Random(3)
    envs = {v: variant_env(v) for v in VARIANTS}
    results = {"rounds": rounds, "warmup_rounds": warmup, "goal_ms": GOAL_MS, "envs": {}}
    rows = []
    summary = {}
    for version in VERSIONS:
        python = str(env_python(version))
        check = sanity(python)
        fig.log(f"{version}: what loads: {check}")
        times = {v: [] for v in VARIANTS}
        for i in range(warmup + rounds):
            order = list(VARIANTS)
            rng.shuffle(order)
            sample = {v: time_once(python, envs[v]) for v in order}
            if i >= warmup:
                for v in VARIANTS:
                    times[v].append(sample[v])
        diffs = {v: [s - b for s, b in zip(times[v], times["stock"])] for v in ("shim", "off")}
        entry = {
            "python": python,
            "what_loads": check,
            "times_ms": {v: [round(t * 1000, 3) for t in times[v]] for v in VARIANTS},
            "stats_ms": {v: _ms(stats(times[v])) for v in VARIANTS},
            "diff_stats_ms": {v: _ms(stats(diffs[v])) for v in diffs},
        }
        results["envs"][version] = entry
        d, o = entry["diff_stats_ms"]["shim"], entry["diff_stats_ms"]["off"]
        s = entry["stats_ms"]
        fig.log(f"{version}: stock {s['stock']['median']:.2f} ms, shim {s['shim']['median']:.2f} ms, "
                f"diff median {d['median']:+.2f} ms (p90 {d['p90']:+.2f}); off {o['median']:+.2f} ms")
        rows.append([
            f"mlx-lm {version}", rounds, fmt(s["stock"]["median"], " ms"), fmt(s["shim"]["median"], " ms"),
            f"**{d['median']:+.2f} ms**", f"{d['p90']:+.2f} ms", fmt(s["off"]["median"], " ms"),
            f"{o['median']:+.2f} ms", "yes" if d["median"] <= GOAL_MS else "**no**",
        ])
        summary[version] = {"shim_minus_stock_ms": d["median"], "off_minus_stock_ms": o["median"],
                            "meets_goal": d["median"] <= GOAL_MS}
    body = table(
        ["venv", "rounds", "stock median", "shim median", "shim − stock (median of pairs)",
         "p90 of pairs", "`MLX_HOTFIX=0` median", "off − stock", f"≤ {GOAL_MS:g} ms"],
        rows,
    )
    body += ("\n\nEach round runs `python -c pass` once per variant in a shuffled order; the "
             "differences are taken within a round, so drift on a busy machine cancels. "
             "stock: no PYTHONPATH; shim: `PYTHONPATH=<repo>/sitecustomize`; off: the same with "
             "`MLX_HOTFIX=0`. Times are spawn to reaped exit, measured by the parent.")
    fig.write(results, body, summary)
    return 0


def _ms(s: dict) -> dict:
    return {k: (v * 1000 if isinstance(v, float) else v) for k, v in s.items()}


if __name__ == "__main__":
    run_main(main)
