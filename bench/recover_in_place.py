"""Recover in place (MLX_HOTFIX_RECOVER=thread) against exit-and-restart under
supervise: from a death of the generation thread to serving again (issue 11).

A real stock mlx_lm.server 0.32.2 with the shim, on a generated random-weight
llama big enough that loading it takes several seconds (hidden 2048, 16
layers, float32: about 2.4 GB; --quick: a quarter of that), run under
`mlx-watchdog supervise` with its default settings (only `--log-format json
--state-file <tmp>` added) in both modes:

  in place  MLX_HOTFIX_RECOVER=thread: the death is answered (503), a fresh
            generation loop serves in the same process with the loaded model.
  restart   the default: the death is answered, the process exits 70, the
            supervisor starts a new one, which loads the model again.

Each death: the one-shot fault (harness/faults,
MLX_TEST_FAULT=raise:typeerror:decode:2, MLX_TEST_FAULT_ONESHOT=1) is armed,
one client request dies on it. From the fault's `t=` (written just before it
raises) to the first one-token completion answered 200 (polled every 0.1 s).
Three deaths per mode, one run, the same machine. The model's size and its
load time (mlx_lm.load in a fresh process, page cache warm) are reported too.

    .venvs/mlx-lm-0.32.2/bin/python -m bench.recover_in_place [--quick] [--deaths N]
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

import requests

from bench.common import quiet
from bench.common import (
    CLEANUP,
    FAULTS_DIR,
    ROOT,
    SHIM_DIR,
    Figure,
    env_python,
    fmt,
    kill_group,
    stats,
    table,
    temp_dir,
)
from harness.server import base_env, free_port

VERSION = "0.32.2"
FAULT = "raise:typeerror:decode:2"
FAULT_LINE = re.compile(rb"mlx-test-fault: raise at \w+ t=([0-9.]+)")
MODES = {"in place": {"MLX_HOTFIX_RECOVER": "thread"}, "restart": {}}
SIZES = {"full": dict(hidden_size=2048, num_layers=16), "quick": dict(hidden_size=1024,
                                                                        num_layers=16)}


def _add_arguments(parser):
    parser.add_argument("--deaths", type=int, default=3, help="deaths per mode [default: 3]")
    parser.add_argument("--model", type=Path, default=None,
                        help="a model folder built before (else one is generated)")


def build(out_dir: Path, size: dict) -> Path:
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from harness.tinymodel import build_llama\n"
            "build_llama(%r, dtype='float32', **%r)\n" % (str(ROOT), str(out_dir), size))
    subprocess.run([str(env_python(VERSION)), "-c", code], check=True, timeout=1800,
                   env=base_env(shim=False))
    return out_dir


def load_seconds(model: Path) -> float:
    """mlx_lm.load of the model in a fresh process (what a restart pays)."""
    code = ("import time, mlx_lm; t = time.perf_counter(); mlx_lm.load(%r); "
            "print(time.perf_counter() - t)" % str(model))
    out = subprocess.run([str(env_python(VERSION)), "-c", code], check=True, timeout=600,
                         capture_output=True, text=True, env=base_env(shim=False))
    return float(out.stdout.strip().splitlines()[-1])


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


def run_mode(figure: Figure, mode: str, model: Path, tmp: Path, deaths: int) -> dict:
    python = env_python(VERSION)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    arm = tmp / f"arm-{mode.replace(' ', '-')}"
    env = base_env(shim=False, extra=dict(
        MODES[mode], PYTHONPATH=f"{SHIM_DIR}:{FAULTS_DIR}", MLX_TEST_FAULT=FAULT,
        MLX_TEST_FAULT_ARM_FILE=str(arm), MLX_TEST_FAULT_ONESHOT="1", MLX_TEST_TRACE_LOADS="1"))
    log_path = tmp / f"{mode.replace(' ', '-')}.log"
    server = [str(python), "-m", "mlx_lm", "server", "--model", str(model),
              "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        sup = CLEANUP.add(subprocess.Popen(
            [str(python), "-m", "mlx_watchdog", "supervise", "--log-format", "json",
             "--state-file", str(tmp / "state.json"), "--", *server],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    results = []
    try:
        started = time.time()
        if serving_at(url, started + 600) is None:
            return {"error": "never served", "log": log_path.read_text()[-2000:]}
        figure.log(f"{mode}: serving {time.time() - started:.1f} s after start")
        for death in range(deaths):
            time.sleep(6)  # past a probe or two of the supervisor
            arm.touch()
            threading.Thread(target=quiet, args=(lambda: chat(url, 16, 120),),
                             daemon=True).start()
            deadline, struck = time.time() + 120, None
            while struck is None and time.time() < deadline:
                hits = FAULT_LINE.findall(log_path.read_bytes())
                struck = float(hits[death]) if len(hits) > death else None
                time.sleep(0.05)
            if struck is None:
                results.append({"error": "the fault did not strike"})
                break
            back = serving_at(url, time.time() + 600)
            seconds = None if back is None else round(back - struck, 2)
            results.append({"to_serving_s": seconds})
            figure.log(f"{mode}: death {death + 1}: serving again after {seconds} s")
        text = log_path.read_text(errors="replace")
        return {"deaths": results, "model_loads": text.count("mlx-test-trace: model load"),
                "recovered_in_place": text.count("mlx-hotfix: recovered:")}
    finally:
        kill_group(sup, wait_s=60)
        CLEANUP.discard(sup)



def main() -> int:
    figure = Figure("recover_in_place",
                    "Figure 9: recover in place vs exit and restart, death to serving",
                    __doc__, add_arguments=_add_arguments)
    tmp = temp_dir("bench-recover-")
    size = SIZES["quick" if figure.quick else "full"]
    model = figure.args.model or build(tmp / "model", size)
    size_gb = sum(p.stat().st_size for p in Path(model).iterdir()) / 1e9
    load_s = load_seconds(model)
    figure.log(f"model {model}: {size_gb:.2f} GB, mlx_lm.load {load_s:.1f} s")
    results = {"version": VERSION, "fault": FAULT,
               "model": dict(size, dtype="float32", size_gb=round(size_gb, 2),
                             load_s=round(load_s, 2)), "modes": {}}
    for mode in MODES:
        results["modes"][mode] = run_mode(figure, mode, Path(model), tmp, figure.args.deaths)
    medians = {}
    rows = []
    for mode, outcome in results["modes"].items():
        times = [d["to_serving_s"] for d in outcome.get("deaths", []) if d.get("to_serving_s")]
        medians[mode] = stats(times)["median"] if times else None
        rows.append((mode, ", ".join(f"{t:.2f}" for t in times) or outcome.get("error", "-"),
                     fmt(medians[mode], " s"), outcome.get("model_loads", "-")))
    inplace, restart = medians["in place"], medians["restart"]
    ratio = restart / inplace if inplace and restart else None
    results["ratio_restart_over_in_place"] = ratio
    body = (
        f"Death of the generation thread to the first one-token completion answered 200, "
        f"under `mlx-watchdog supervise` (defaults), mlx-lm {VERSION} with the shim. Model: "
        f"random llama, hidden {size['hidden_size']}, {size['num_layers']} layers, float32, "
        f"{size_gb:.2f} GB; `mlx_lm.load` takes {load_s:.1f} s in a fresh process.\n\n"
        + table(("mode", "death to serving, each (s)", "median", "model loads in the run"),
                rows)
        + f"\n\nIn place is **{fmt(ratio, 'x', 1)}** faster than exit and restart "
          "(median against median; model loads include the start-up load).")
    figure.write(results, body, summary={"ratio": ratio, "in_place_s": inplace,
                                         "restart_s": restart, "load_s": round(load_s, 2),
                                         "size_gb": round(size_gb, 2)})
    return 0 if ratio else 1


if __name__ == "__main__":
    from bench.common import run_main

    run_main(main)
