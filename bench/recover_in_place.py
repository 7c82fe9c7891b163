"""Figure 9: recover in place (MLX_HOTFIX_RECOVER=thread) against exit and
reload under supervise: from a death of the generation thread to serving again.

A real stock mlx_lm.server 0.32.2 with the shim, run under `mlx-watchdog
supervise` with its default settings (only `--log-format json --state-file
<tmp>` added), in both modes:

  in place  MLX_HOTFIX_RECOVER=thread: the death is answered (503), a fresh
            generation loop serves in the same process with the loaded model
            (and, on a first death, the prompt cache it had).
  restart   the default: the death is answered, the process exits 70, the
            supervisor starts a new one, which loads the model again.

The model: a generated random-weight qwen3_next whose load is slow and whose
decoding is fast, as a large mixture-of-experts model's is: its weights are
mostly experts (hidden 256, 4 layers, N experts of which 2 run per token),
float32, several GB (--quick: a smaller one), so a restart pays for reading
all of them while a token costs only what two experts cost. If `mlx_lm.load`
of it in a fresh process (page cache warm, as for a restart) takes less than
5 s on this machine, the model is rebuilt larger once (bounded by a third of
the RAM; not in --quick), so that the reload is worth avoiding.

Each death: the one-shot fault (harness/faults,
MLX_TEST_FAULT=raise:typeerror:decode:2, MLX_TEST_FAULT_ONESHOT=1) is armed,
one client request dies on it. From the fault's `t=` (written just before it
raises) to the first one-token completion answered 200 (one at a time, polled
every 0.1 s). In place, the shim's own part too: the fault's `t=` to the
arrival of its `recovered:` line. One more death per mode, after the measured
ones, runs under steady client traffic for the plot. Goal: in place <= 0.5 s
and >= 10x faster than the restart.

    <main python> -m bench.recover_in_place [--quick] [--deaths N] [--model DIR]
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

import requests

from bench.common import (
    FAULTS_DIR,
    ROOT,
    SHIM_DIR,
    Figure,
    env_python,
    fmt,
    quiet,
    run_main,
    stats,
    table,
    temp_dir,
)
from bench.procs import TimedProcess
from bench.timeline import LEAD_S, Traffic
from harness.server import base_env, free_port

VERSION = "0.32.2"
FAULT = "raise:typeerror:decode:2"
FAULT_LINE = re.compile(r"mlx-test-fault: raise at \w+ t=([0-9.]+)")
RECOVERED_LINE = re.compile(r"mlx-hotfix: recovered:")
# Baseline first. In place: room for every death of the run (3 in 600 s by default).
MODES = {"restart": {}, "in place": {"MLX_HOTFIX_RECOVER": "thread",
                                     "MLX_HOTFIX_RECOVER_LIMIT": "1000"}}
GOAL_S, GOAL_RATIO, MIN_LOAD_S = 0.5, 10.0, 5.0
SHAPE = dict(hidden_size=256, num_layers=4, num_experts_per_tok=2)
EXPERTS = {"full": 4096, "quick": 1024}  # about 6.4 GB and 1.6 GB in float32
AFTER_SERVING_S = 5.0


def _add_arguments(parser):
    parser.add_argument("--deaths", type=int, default=None,
                        help="measured deaths per mode [default: 5; --quick: 3]")
    parser.add_argument("--model", type=Path, default=None,
                        help="a model folder built before (else one is generated)")


def build(out_dir: Path, experts: int) -> Path:
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from harness.tinymodel import build_qwen3_next\n"
            "build_qwen3_next(%r, num_experts=%d, dtype='float32', **%r)\n"
            % (str(ROOT), str(out_dir), experts, SHAPE))
    subprocess.run([str(env_python(VERSION)), "-c", code], check=True, timeout=3600,
                   env=base_env(shim=False))
    return out_dir


def load_seconds(model: Path) -> float:
    """mlx_lm.load of the model in a fresh process (what a restart pays for it)."""
    code = ("import time, mlx_lm; t = time.perf_counter(); mlx_lm.load(%r); "
            "print(time.perf_counter() - t)" % str(model))
    out = subprocess.run([str(env_python(VERSION)), "-c", code], check=True, timeout=1800,
                         capture_output=True, text=True, env=base_env(shim=False))
    return float(out.stdout.strip().splitlines()[-1])


def size_gb(model: Path) -> float:
    return sum(p.stat().st_size for p in Path(model).iterdir()) / 1e9


def slow_enough_model(figure: Figure, tmp: Path) -> tuple:
    """(model folder, experts, load seconds): rebuilt larger once if it loads in < 5 s."""
    experts = EXPERTS["quick" if figure.quick else "full"]
    model = build(tmp / f"model-{experts}", experts)
    load_s = load_seconds(model)
    figure.log(f"model: {experts} experts, {size_gb(model):.2f} GB, loads in {load_s:.1f} s")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    if load_s < MIN_LOAD_S and not figure.quick:
        scale = MIN_LOAD_S * 1.3 / max(load_s, 0.1)
        bigger = int(min(experts * scale, experts * ram / 3 / size_gb(model)))
        if bigger > experts:
            import shutil

            shutil.rmtree(model)
            experts = bigger
            model = build(tmp / f"model-{experts}", experts)
            load_s = load_seconds(model)
            figure.log(f"rebuilt: {experts} experts, {size_gb(model):.2f} GB, "
                       f"loads in {load_s:.1f} s")
    return model, experts, load_s


def chat(url, max_tokens=1, timeout=(0.5, 30)):
    body = {"model": "default_model", "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": "are you there"}]}
    return requests.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)


def serving_at(url, deadline):
    """When a one-token completion is first answered 200. One request at a
    time, with a read timeout longer than any answer: a poll that gave up
    would leave its request queued, and the queue would delay the next."""
    while time.time() < deadline:
        try:
            r = chat(url, timeout=(0.5, max(1.0, deadline - time.time())))
            if r.status_code == 200 and r.json().get("choices"):
                return time.time()
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.1)
    return None


def one_death(sup: TimedProcess, url: str, arm: Path, traffic: Optional[Traffic]) -> dict:
    start = len(sup.out.lines)
    arm.touch()
    threading.Thread(target=quiet, args=(lambda: chat(url, 16, 120),), daemon=True).start()
    hit = sup.out.wait_line(FAULT_LINE, 120, start)
    if hit is None:
        return {"error": "the fault did not strike"}
    struck = float(hit[2].group(1))
    back = serving_at(url, time.time() + 900)
    recovered = sup.out.find(RECOVERED_LINE, start)
    record = {"to_serving_s": None if back is None else round(back - struck, 3),
              "to_recovered_line_s": round(recovered[1] - struck, 3) if recovered else None}
    if traffic is not None:
        time.sleep(max(0.0, (back or time.time()) + AFTER_SERVING_S - time.time()))
        traffic.stop()
        record["timeline"] = traffic.timeline(struck, [
            (recovered[1] if recovered else None, "recovered in place"),
            (back, "serving again")])
    return record


def run_mode(figure: Figure, mode: str, model: Path, tmp: Path, deaths: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    name = mode.replace(" ", "-")
    arm = tmp / f"arm-{name}"
    env = base_env(shim=False, extra=dict(
        MODES[mode], PYTHONPATH=f"{SHIM_DIR}:{FAULTS_DIR}", MLX_TEST_FAULT=FAULT,
        MLX_TEST_FAULT_ARM_FILE=str(arm), MLX_TEST_FAULT_ONESHOT="1", MLX_TEST_TRACE_LOADS="1"))
    server = [str(env_python(VERSION)), "-m", "mlx_lm", "server", "--model", str(model),
              "--host", "127.0.0.1", "--port", str(port)]
    sup = TimedProcess([str(env_python(VERSION)), "-m", "mlx_watchdog", "supervise",
                        "--log-format", "json", "--state-file", str(tmp / f"state-{name}.json"),
                        "--", *server], env, tmp / f"{name}.log")
    records = []
    try:
        started = time.time()
        if serving_at(url, started + 900) is None:
            return {"error": "never served", "log": sup.out.text()[-2000:]}
        figure.log(f"{mode}: serving {time.time() - started:.1f} s after start")
        for death in range(deaths + 1):
            time.sleep(6)  # past a probe or two of the supervisor
            traffic = None
            if death == deaths:  # the extra death, under traffic, for the plot
                traffic = Traffic(url).start()
                time.sleep(LEAD_S)
            record = one_death(sup, url, arm, traffic)
            records.append(record)
            figure.log(f"{mode}: death {death + 1}{' (plot)' if traffic else ''}: serving "
                       f"again after {record.get('to_serving_s')} s (recovered line "
                       f"{record.get('to_recovered_line_s')} s)")
            if "error" in record:
                break
        text = sup.out.text()
        return {"deaths": records[:deaths], "plot_death": records[deaths:],
                "model_loads": text.count("mlx-test-trace: model load"),
                "recovered_in_place": text.count("mlx-hotfix: recovered:"),
                "prompt_cache_kept": text.count("mlx-hotfix: prompt cache kept")}
    finally:
        sup.stop(term_grace=60)


def main() -> int:
    figure = Figure("recover_in_place",
                    "Figure 9: recover in place vs exit and reload, death to serving",
                    __doc__, add_arguments=_add_arguments)
    deaths = figure.args.deaths or (3 if figure.quick else 5)
    tmp = temp_dir("bench-recover-")
    if figure.args.model:
        model, experts = figure.args.model, None
        load_s = load_seconds(model)
    else:
        model, experts, load_s = slow_enough_model(figure, tmp)
    gb = size_gb(model)
    results = {"version": VERSION, "fault": FAULT, "deaths_per_mode": deaths,
               "model": dict(SHAPE, num_experts=experts, kind="qwen3_next", dtype="float32",
                             size_gb=round(gb, 2), load_s=round(load_s, 2)),
               "modes": {}}
    for mode in MODES:
        results["modes"][mode] = run_mode(figure, mode, Path(model), tmp, deaths)

    medians, rows = {}, []
    for mode, outcome in results["modes"].items():
        done = [d for d in outcome.get("deaths", []) if d.get("to_serving_s")]
        serve = stats(d["to_serving_s"] for d in done)
        line = stats(d["to_recovered_line_s"] for d in done if d.get("to_recovered_line_s"))
        medians[mode] = serve["median"]
        rows.append([mode, f"{serve['n']}/{len(outcome.get('deaths', []))}"
                     if "deaths" in outcome else outcome.get("error", "-"),
                     f"**{fmt(serve['median'], ' s', 2)}** / {fmt(serve['max'], ' s', 2)}",
                     f"{fmt(line['median'], ' s', 3)} / {fmt(line['max'], ' s', 3)}"
                     if line["n"] else "-",
                     outcome.get("model_loads", "-")])
    inplace, restart = medians["in place"], medians["restart"]
    ratio = restart / inplace if inplace and restart else None
    met = bool(inplace is not None and inplace <= GOAL_S and ratio and ratio >= GOAL_RATIO)
    plots = {mode: (outcome.get("plot_death") or [{}])[0].get("timeline")
             for mode, outcome in results["modes"].items()}
    if all(plots.values()):
        results["timelines"] = {"death": {
            "title": f"a death, mlx-lm {VERSION}, a {gb:.1f} GB model: requests answered "
                     "per second", "zero": "death",
            "arms": {"exit and reload (default)": plots["restart"],
                     "recover in place (MLX_HOTFIX_RECOVER=thread)": plots["in place"]}}}
    results["ratio_restart_over_in_place"] = ratio
    body = (
        f"**Death to serving again** (median / max over {deaths} deaths; goal: in place ≤ "
        f"{GOAL_S:g} s and ≥ {GOAL_RATIO:g}x faster than exit and reload: "
        f"**{'met' if met else 'not met'}**)\n\n"
        + table(["mode", "served again", "death → serving", "death → `recovered:` line",
                 "model loads in the run"], rows)
        + f"\n\nIn place is **{fmt(ratio, 'x', 1)}** faster than exit and reload (median "
          "against median; model loads include the start-up load). Under `mlx-watchdog "
          f"supervise` (defaults), mlx-lm {VERSION} with the shim. Model: random qwen3_next, "
          f"hidden {SHAPE['hidden_size']}, {SHAPE['num_layers']} layers, "
          f"{experts or '?'} experts (2 per token), float32, {gb:.2f} GB; `mlx_lm.load` takes "
          f"{load_s:.1f} s in a fresh process (page cache warm). Serving again: the first "
          "one-token completion answered 200 (one at a time, every 0.1 s). The `recovered:` "
          "line: when the shim's line arrived at the bench (the recovery itself). Plot: one "
          "more death per mode under steady traffic (bench/timeline.py: 2 clients, one 4-token "
          f"completion after another, from {LEAD_S:g} s before the death).")
    figure.write(results, body, summary={
        "ratio": ratio, "in_place_s": inplace, "restart_s": restart, "goal_met": met,
        "load_s": round(load_s, 2), "load_at_least_5_s": load_s >= MIN_LOAD_S,
        "size_gb": round(gb, 2)})
    return 0 if ratio else 1


if __name__ == "__main__":
    run_main(main)
