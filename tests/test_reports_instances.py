"""Crash reports belong to an instance: two real supervised stock servers
share one report folder (as installed instances do); one dies, the other
serves. Each report names its instance, `status` and the crash-report
counter of each instance count only its own, and `reports --instance`
lists one instance's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import requests

from harness.server import base_env, free_port, python_for
from harness.watchdog_run import WatchdogProcess, wait_serving
from tests.conftest import fault_env

pytestmark = pytest.mark.server


def _counter(metrics_port: int, name: str) -> float:
    text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f'mlx_watchdog_crash_reports_total{{instance="{name}"}}'):
            return float(line.split()[-1])
    raise AssertionError(text)


def test_reports_status_and_counters_are_per_instance(tmp_path, tiny_llama):
    reports = tmp_path / "reports"
    arm = tmp_path / "arm"
    started = {}
    for name in ("qwen", "gemma"):
        port, metrics_port = free_port(), free_port()
        env = base_env(shim=False)
        if name == "qwen":  # only qwen meets the fault
            env.update(fault_env("raise:resource:decode", arm, shim=False))
        sup = WatchdogProcess(tmp_path, [
            "supervise", "--name", name, "--report-dir", str(reports),
            "--metrics-port", str(metrics_port), "--probe-interval", "1", "--",
            str(python_for("0.32.2")), "-m", "mlx_lm", "server", "--model", str(tiny_llama),
            "--host", "127.0.0.1", "--port", str(port)],
            name=name, env=env)
        started[name] = (sup, port, metrics_port)
    try:
        for sup, port, _ in started.values():
            wait_serving(f"http://127.0.0.1:{port}", 180, log=sup)
        qwen, qwen_port, qwen_metrics = started["qwen"]
        arm.touch()
        qwen.wait_event(lambda e: e["event"] == "restart", 120, "qwen's restart")
        arm.unlink()
        (report,) = [json.loads(p.read_text()) for p in reports.glob("*.json")]
        assert report["instance"] == {"name": "qwen", "port": qwen_port,
                                      "model": str(tiny_llama)}
        qwen.wait_for(lambda: _counter(qwen_metrics, "qwen") == 1, 60, "qwen's counter")
        gemma, _, gemma_metrics = started["gemma"]
        assert _counter(gemma_metrics, "gemma") == 0  # not gemma's report
        for name, (sup, _, _) in started.items():
            record = sup.wait_for(lambda s=sup, n=name: s.record(n).get("state") == "healthy"
                                  and s.record(n), 120, f"{name} healthy")
            newest = record.get("newest_report")
            if name == "qwen":
                assert newest and newest["file"].endswith(".json"), record
            else:
                assert newest is None, record
        listed = subprocess.run(
            [sys.executable, "-m", "mlx_watchdog", "reports", "--dir", str(reports),
             "--instance", "gemma"], capture_output=True, text=True, timeout=60)
        assert listed.stdout.startswith("no reports in"), listed.stdout
        listed = subprocess.run(
            [sys.executable, "-m", "mlx_watchdog", "reports", "--dir", str(reports)],
            capture_output=True, text=True, timeout=60)
        assert listed.stdout.splitlines()[1].split()[4] == "qwen", listed.stdout
    finally:
        for sup, _, _ in started.values():
            sup.cleanup()
