"""Figure 11: distributed group, death to serving and hang to serving, 2-rank group vs one process.

A real stock mlx_lm.server 0.32.2 (tiny random llama, CPU), run either alone
or as a 2-rank `mlx.launch -n 2 --backend ring` group on this host, under
`mlx-watchdog supervise` with DEFAULT settings (only `--log-format json
--state-file <tmp>` added). The fault (harness/faults) strikes rank 1
of the group, or the lone server, after a warm-up:

  death  raise:typeerror:decode  the generation thread dies
  hang   hang:decode             the generation loop blocks at 0% CPU

From the fault's `t=` (written just before it acts) to the first one-token
completion answered 200 (polled every 0.1 s). One run of each, same machine,
same run; the ratio group/single is the figure. --quick changes nothing
(one run of each is already the least).

    <main python> -m bench.group_recovery [--quick] [--results-dir DIR]
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path

import requests

from bench.common import CLEANUP, Figure, quiet, run_main, table, temp_dir
from harness import FAULTS_DIR
from harness.procs import chat, kill_group
from harness.server import base_env, free_port, python_for
from harness.tinymodel import build_llama

FAULTS = {"death": "raise:typeerror:decode", "hang": "hang:decode"}
FAULT_LINE = re.compile(rb"mlx-test-fault: \w+ at \w+ t=([0-9.]+)")
VERSION = "0.32.2"


def serving_at(url, deadline):
    while time.time() < deadline:
        try:
            r = chat(url, "are you there", max_tokens=1, timeout=(0.5, 3))
            if r.status_code == 200 and r.json().get("choices"):
                return time.time()
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.1)
    return None


def one(kind: str, shape: str, model: Path, tmp: Path) -> dict:
    python = python_for(VERSION)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = [str(python), "-m", "mlx_lm", "server", "--model", str(model),
              "--host", "127.0.0.1", "--port", str(port)]
    if shape == "group":
        server = [str(python.parent / "mlx.launch"), "-n", "2", "--backend", "ring", "--",
                  *server]
    arm = tmp / f"arm-{kind}-{shape}"
    env = base_env(shim=False, extra={
        "PYTHONPATH": str(FAULTS_DIR), "MLX_TEST_FAULT": FAULTS[kind],
        "MLX_TEST_FAULT_ARM_FILE": str(arm), "MLX_TEST_FAULT_RANK": "1" if shape == "group" else ""})
    log_path = tmp / f"{kind}-{shape}.log"
    with open(log_path, "wb") as log:
        sup = CLEANUP.add(subprocess.Popen(
            [str(python), "-m", "mlx_watchdog", "supervise", "--log-format", "json",
             "--state-file", str(tmp / f"{kind}-{shape}.state.json"), "--", *server],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        if serving_at(url, time.time() + 300) is None:
            return {"error": "never served"}
        time.sleep(6)  # past a probe or two
        arm.touch()
        threading.Thread(target=lambda: quiet(lambda: chat(url, max_tokens=20, timeout=90)), daemon=True).start()
        deadline = time.time() + 90
        struck = None
        while struck is None and time.time() < deadline:
            hit = FAULT_LINE.search(log_path.read_bytes())
            struck = float(hit.group(1)) if hit else None
            time.sleep(0.05)
        arm.unlink()
        if struck is None:
            return {"error": "the fault did not strike"}
        back = serving_at(url, time.time() + 300)
        return {"to_serving_s": None if back is None else round(back - struck, 2)}
    finally:
        kill_group(sup, grace_s=60)  # SIGTERM: the supervisor stops its child first
        CLEANUP.discard(sup)



def main() -> int:
    fig = Figure("group_recovery", "Figure 11: a fault on rank 1 of a group to serving again",
                 __doc__)
    os.environ["HF_HUB_OFFLINE"] = "1"
    results = {}
    tmp = temp_dir("bench-group-")
    model = build_llama(tmp / "tiny")
    for kind in FAULTS:
        for shape in ("single", "group"):
            results[f"{kind}/{shape}"] = one(kind, shape, model, tmp)
            fig.log(f"{kind} {shape}: {results[f'{kind}/{shape}']}")
    rows, summary = [], {}
    for kind in FAULTS:
        single = results[f"{kind}/single"].get("to_serving_s")
        grouped = results[f"{kind}/group"].get("to_serving_s")
        ratio = grouped / single if single and grouped else None
        summary[kind] = {"single_s": single, "group_s": grouped, "group_over_single": ratio}
        rows.append([kind, f"{single} s", f"{grouped} s",
                     "n/a" if ratio is None else f"{ratio:.2f}x"])
    body = table(["fault", "single process", "2-rank ring group", "group / single"], rows)
    body += (f"\n\nFault on rank 1 (or the lone server) to the first one-token completion "
             f"answered 200, under `mlx-watchdog supervise` (defaults). One run each (a single "
             f"run has no noise estimate: read the ratio as rough), mlx-lm {VERSION}, tiny "
             f"llama on CPU.")
    fig.write(results, body, summary)
    return 0 if all("to_serving_s" in r for r in results.values()) else 1


if __name__ == "__main__":
    run_main(main)
