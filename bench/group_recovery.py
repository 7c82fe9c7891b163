"""Distributed group: a fault on rank 1 to serving again, one process, a group on
one host, and a group on two hosts (rank 1 over a real ssh), in one run.

A real stock mlx_lm.server 0.32.2 (tiny random llama, CPU) under
`mlx-watchdog supervise` with DEFAULT settings (only `--log-format json
--state-file <tmp>` added, and `--remote-shim-path` for two hosts), run:

  single     alone
  one host   `mlx.launch -n 2 --backend ring` on this host
  two hosts  `mlx.launch --hostfile` with rank 1 on a second host: a private
             sshd on 127.0.0.2 reached as `mlxhost2` (harness/remotehost.py;
             needs root and openssh-server), the shim there from its own copy

The fault strikes rank 1 of a group (the lone server alone), after a warm-up:

  death      raise:typeerror:decode  the generation thread dies
  hang       hang:decode             the generation loop blocks at 0% CPU
  partition  (two hosts only) every packet to and from the second host
             dropped (iptables, both ways of the ring) for PARTITION_S during
             a streamed request, then healed

From the fault's `t=` (written just before it acts), or the start of the
partition, to the first one-token completion answered 200 (polled every
0.1 s); for the partition also from the heal. Then how many rank processes
run on the second host (1: nothing of the old group left). One run of each;
ratios against the lone server and the one-host group are the figures.

    .venvs/mlx-lm-0.32.2/bin/python -m bench.group_recovery [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import requests

from bench.common import quiet, stamp, stamp_line
from harness import FAULTS_DIR, ROOT
from harness.procs import chat, kill_group
from harness.remotehost import SecondHost, SecondHostUnavailable
from harness.server import base_env, free_port, python_for
from harness.tinymodel import build_llama

FAULTS = {"death": "raise:typeerror:decode", "hang": "hang:decode", "partition": None}
SHAPES = ("single", "one host", "two hosts")
FAULT_LINE = re.compile(rb"mlx-test-fault: \w+ at \w+ t=([0-9.]+)")
VERSION = "0.32.2"
PARTITION_S = 30.0  # about the 33 s partition of the trial issue 24 reports


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


def supervise(shape: str, kind: str, model: Path, tmp: Path, host: Optional[SecondHost]):
    """Start the server or group under supervise; (process, url, arm file, log path)."""
    python = python_for(VERSION)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = [str(python), "-m", "mlx_lm", "server", "--model", str(model),
              "--host", "127.0.0.1", "--port", str(port)]
    arm = tmp / f"arm-{kind}-{shape}"
    faults = {"MLX_TEST_FAULT": FAULTS[kind] or FAULTS["death"],
              "MLX_TEST_FAULT_ARM_FILE": str(arm), "MLX_TEST_FAULT_RANK": "1"}
    env = base_env(shim=False)
    options = []
    if shape == "single":
        command = server
        env.update(faults, PYTHONPATH=str(FAULTS_DIR), MLX_TEST_FAULT_RANK="")
    elif shape == "one host":
        command = [str(python.parent / "mlx.launch"), "-n", "2", "--backend", "ring",
                   "--starting-port", str(free_port()), "--", *server]
        env.update(faults, PYTHONPATH=str(FAULTS_DIR))
    else:
        hostfile = host.hostfile(tmp / f"hosts-{kind}.json")
        remote = [f"--env={k}={v}" for k, v in {**faults, "PYTHONPATH": str(FAULTS_DIR)}.items()]
        command = [str(python.parent / "mlx.launch"), "--hostfile", str(hostfile),
                   "--backend", "ring", "--starting-port", str(free_port()), *remote,
                   "--", *server]
        env = host.env(env)
        options = ["--remote-shim-path", str(host.shim_dir)]
    log_path = tmp / f"{kind}-{shape.replace(' ', '-')}.log"
    env["MLX_HOTFIX_REPORT_DIR"] = str(tmp / "reports")
    with open(log_path, "wb") as log:
        sup = subprocess.Popen(
            [str(python), "-m", "mlx_watchdog", "supervise", "--log-format", "json",
             "--state-file", str(tmp / f"{kind}-{shape}.state.json"), *options, "--", *command],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return sup, url, arm, log_path


def one(kind: str, shape: str, model: Path, tmp: Path, host: Optional[SecondHost]) -> dict:
    sup, url, arm, log_path = supervise(shape, kind, model, tmp, host)
    try:
        if serving_at(url, time.time() + 300) is None:
            return {"error": "never served"}
        time.sleep(6)  # past a probe or two
        result = {}
        if kind == "partition":
            threading.Thread(target=lambda: quiet(lambda: chat(
                url, max_tokens=100000, timeout=(5, 300), stream=True).content),
                daemon=True).start()
            time.sleep(1.0)  # the stream is under way
            with host.partition():
                struck = time.time()
                time.sleep(PARTITION_S)
            healed = time.time()
        else:
            arm.touch()
            threading.Thread(target=lambda: quiet(lambda: chat(url, max_tokens=20, timeout=90)),
                             daemon=True).start()
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
        result["to_serving_s"] = None if back is None else round(back - struck, 2)
        if kind == "partition" and back is not None:
            result["after_heal_s"] = round(back - healed, 2)
        if host is not None and shape == "two hosts":
            time.sleep(5)  # what the stop left behind has had time to go
            result["ranks_on_host_2"] = len(host.ranks())
        return result
    finally:
        kill_group(sup, grace_s=60)  # SIGTERM: the supervisor stops its child first


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--quick", action="store_true",
                        help="accepted for bench/run_all: every case runs once anyway")
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    figure_stamp = stamp("bench.group_recovery", sys.argv[1:], versions=(VERSION,))
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-group-") as folder:
        tmp = Path(folder)
        model = build_llama(tmp / "tiny")
        host: Optional[SecondHost] = SecondHost(tmp / "second-host")
        try:
            host.start()
        except SecondHostUnavailable as exc:
            print(f"no second host: {exc}", file=sys.stderr)
            host.stop()
            host = None
        try:
            for kind in FAULTS:
                for shape in SHAPES:
                    if kind == "partition" and shape != "two hosts":
                        continue
                    if shape == "two hosts" and host is None:
                        results[f"{kind}/{shape}"] = {"error": "no second host (root, sshd)"}
                    else:
                        results[f"{kind}/{shape}"] = one(kind, shape, model, tmp, host)
                    print(kind, shape, results[f"{kind}/{shape}"], flush=True)
        finally:
            if host is not None:
                host.stop()
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "group_recovery.json").write_text(
        json.dumps({**figure_stamp, "results": results}, indent=2, default=str) + "\n")
    (args.results_dir / "group_recovery.md").write_text(table(results, figure_stamp))
    print(table(results, figure_stamp))
    return 0


def _seconds(result: dict, key: str = "to_serving_s") -> Optional[float]:
    return result.get(key) if result else None


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def _cell(result: dict, key: str = "to_serving_s") -> str:
    if "error" in result:
        return f"({result['error']})"
    value = result.get(key)
    return "never" if value is None else f"{value} s"


def table(results: dict, figure_stamp: dict) -> str:
    lines = ["## Distributed group: fault on rank 1 to serving again (supervise, defaults)", "",
             "| fault | single process | group, one host | group, two hosts | two hosts / one "
             "host | two hosts / single | ranks on host 2 after |",
             "|---|---|---|---|---|---|---|"]
    for kind in ("death", "hang"):
        single = results.get(f"{kind}/single", {})
        one_host = results.get(f"{kind}/one host", {})
        two = results.get(f"{kind}/two hosts", {})
        lines.append(f"| {kind} | {_cell(single)} | {_cell(one_host)} | {_cell(two)} | "
                     f"{_ratio(_seconds(two), _seconds(one_host))} | "
                     f"{_ratio(_seconds(two), _seconds(single))} | "
                     f"{two.get('ranks_on_host_2', 'n/a')} |")
    part = results.get("partition/two hosts", {})
    lines.append(f"| partition ({PARTITION_S:g} s) | | | {_cell(part)} "
                 f"({_cell(part, 'after_heal_s')} after the heal) | | | "
                 f"{part.get('ranks_on_host_2', 'n/a')} |")
    lines += ["", "_From the fault (or the partition's start) to the first 200 completion. "
              "Two hosts: rank 1 behind a real sshd on 127.0.0.2 of the same machine, so no "
              "network latency is in it. One run each (no noise estimate: read the ratios as "
              f"rough), mlx-lm {VERSION}, tiny llama on CPU; {stamp_line(figure_stamp)}._", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
