"""Figure 8: the shim's own work per generated token, wrapper by wrapper.

Every token a server generates passes a few hook points the shim wraps: the
generation thread's ``rqueue.put(Response)`` (the heartbeat counts the
delivery), one ``TimeBudget.__next__`` per decode step, and on the request
thread the response queue's ``get`` and the stream ``generate`` returns. For
each release, bench/per_token_probe.py runs in that release's venv with the
shim on PYTHONPATH (``import mlx_lm.server`` applies it as in a server) and
times every layer of every chain alone, on stock's own objects: a wrapper's
cost is its layer minus the layer below it, down to stock.

Robust on a busy machine: each layer is R repeats of N calls, the layers
interleaved, and the figure is the least thread CPU time per call over the
repeats (a busy machine only adds time). Goal: at most 5 µs per token in all.
"""

from __future__ import annotations

import json
import subprocess

from bench.common import BENCH, VERSIONS, Figure, env_python, run_main, table
from harness.server import base_env

PROBE = BENCH / "per_token_probe.py"
GOAL_US = 5.0
HOOKS = {
    "put": "`rqueue.put(Response)`, generation thread",
    "turn": "`TimeBudget.__next__`, one per decode step",
    "get": "`Queue.get`, request thread (non-streaming client)",
    "stream": "`generate`'s stream, per item",
    "advance": "`ArraysCache.advance` + a `lengths` read, per linear-attention layer "
               "(hybrid models only)",
}


def probe(version: str, calls: int, repeats: int) -> dict:
    out = subprocess.run(
        [str(env_python(version)), str(PROBE), "--calls", str(calls), "--repeats", str(repeats)],
        capture_output=True, text=True, timeout=1800, check=True,
        env=base_env(shim=True))
    return json.loads(out.stdout.strip().splitlines()[-1])


def wrapper_rows(measured: dict) -> dict:
    """{(hook, part): ns per call} of every shim layer, and {hook: stock ns}."""
    costs, stock = {}, {}
    for hook in HOOKS:
        for layer in measured.get(hook, []):
            if layer.get("baseline"):
                stock[hook] = layer["ns"]
            else:
                costs[(hook, layer["part"])] = layer["ns"]
    return {"costs": costs, "stock": stock}


def main() -> int:
    fig = Figure("per_token_cost", "Figure 8: the shim's own work per generated token", __doc__)
    calls, repeats = (1000, 40) if fig.quick else (2000, 300)
    results = {"calls": calls, "repeats": repeats, "goal_us": GOAL_US, "releases": {}}
    rows_by_key: dict = {}
    totals, summary = {}, {}
    for version in VERSIONS:
        fig.log(f"mlx-lm {version}: {repeats} repeats of {calls} calls per layer")
        measured = probe(version, calls, repeats)
        results["releases"][version] = measured
        split = wrapper_rows(measured)
        # A layer a hair cheaper than the one below it is noise, not a saving.
        # advance is per linear-attention layer, and of hybrid models only: apart.
        totals[version] = sum(max(0.0, ns) for (hook, _), ns in split["costs"].items()
                              if hook != "advance") / 1000
        for (hook, part), ns in split["costs"].items():
            rows_by_key.setdefault((hook, part), {})[version] = ns
        for hook, ns in split["stock"].items():
            rows_by_key.setdefault((hook, "stock itself"), {})[version] = ns
        summary[version] = {"total_us_per_token": round(totals[version], 3),
                            "meets_goal": totals[version] <= GOAL_US}
        fig.log(f"mlx-lm {version}: {totals[version]:.2f} µs per token")
    order = {hook: i for i, hook in enumerate(HOOKS)}
    rows = []
    for (hook, part), per_version in sorted(
            rows_by_key.items(), key=lambda kv: (order[kv[0][0]], kv[0][1] == "stock itself")):
        label = f"_{part}_" if part == "stock itself" else f"`{part}`"
        rows.append([HOOKS[hook], label] + [
            "n/a" if v not in per_version else f"{per_version[v] / 1000:.3f}" for v in VERSIONS])
    rows.append(["**all the shim's wrappers, per token**", ""]
                + [f"**{totals[v]:.2f}**" for v in VERSIONS])
    rows.append([f"≤ {GOAL_US:g} µs", ""] + ["yes" if totals[v] <= GOAL_US else "**no**"
                                             for v in VERSIONS])
    body = table(["hook point", "wrapper (part)"] + [f"µs per call, mlx-lm {v}" for v in VERSIONS],
                 rows)
    body += (
        "\n\nEach shim layer's figure is its own work (its layer's time minus the layer "
        "below it); _stock itself_ is what stock's code costs at that point, for scale. "
        "One token costs one put, one get and one stream item; one decode step of the batch "
        "costs one turn (one per token with one request, less with several). Measured in "
        f"process (bench/per_token_probe.py): {repeats} repeats of {calls} calls per layer, "
        "layers interleaved, the least thread CPU time (`time.thread_time_ns`) per call over "
        "the repeats; the get side as a non-streaming client the `disconnect` part watches "
        "(its costlier case). The total counts a layer measured cheaper than the one below it "
        "as 0, and leaves `advance` out: it runs once per linear-attention layer per step, in "
        "hybrid models only, and replaces stock's `-=` on two arrays (a negative figure is a "
        "saving over stock).")
    fig.write(results, body, summary)
    return 0


if __name__ == "__main__":
    run_main(main)
