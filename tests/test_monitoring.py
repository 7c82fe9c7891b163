"""monitoring/: the alert rules pass promtool, and every metric the rules and
the Grafana dashboard name is served by a live `mlx-watchdog watch`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from harness.fakeserver import FakeServer
from harness.server import free_port
from harness.watchdog_run import WatchdogProcess

MONITORING = Path(__file__).resolve().parents[1] / "monitoring"
RULES = MONITORING / "alerts.yml"
RULE_TESTS = MONITORING / "alerts-test.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
_METRIC = re.compile(r"\bmlx_watchdog_[a-z_]+")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing: .ci/run installs Debian's prometheus package for it")
        pytest.skip("promtool not installed (apt-get install prometheus); CI installs it")
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=MONITORING, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules():
    result = _run(_promtool(), "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout


def test_promtool_unit_tests_drive_every_alert():
    result = _run(_promtool(), "test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    # Every alert in the rules is exercised by the unit tests.
    alerts = set(re.findall(r"^\s*- alert: (\S+)", RULES.read_text(), re.M))
    tested = set(re.findall(r"alertname: (\S+)", RULE_TESTS.read_text()))
    assert alerts and alerts == tested


def _dashboard_exprs() -> list:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable.get("type") == "query":
            exprs.append(variable["definition"])
    return exprs


def test_dashboard_shows_what_an_operator_needs():
    dashboard = json.loads(DASHBOARD.read_text())
    kinds = {panel["title"]: panel["type"] for panel in dashboard["panels"]}
    assert kinds["State per instance"] == "state-timeline"
    text = DASHBOARD.read_text()
    for metric in ("mlx_watchdog_decode_tokens_total", "mlx_watchdog_prefill_tokens_total",
                   "mlx_watchdog_in_flight", "mlx_watchdog_restarts_total",
                   "mlx_watchdog_probe_latency_seconds_bucket"):
        assert metric in text
    # The state timeline maps every state the judge can give.
    from mlx_watchdog.judge import STATES

    mapping = dashboard["panels"][0]["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert sorted(o["text"] for o in mapping.values()) == sorted(STATES)
    for state in STATES:
        assert f'state="{state}"' in dashboard["panels"][0]["targets"][0]["expr"]


def _served(url: str) -> dict:
    text = requests.get(url, timeout=5).text
    return {
        sample.name: sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
        except requests.RequestException:
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_every_metric_named_by_rules_and_dashboard_is_served_live(tmp_path):
    heartbeat = tmp_path / "mac1.heartbeat"
    reports = tmp_path / "reports"
    reports.mkdir()
    beat = {"pid": 4242, "started": time.time(), "beats": 1, "time": time.time(),
            "phase": "serving", "in_flight": 2, "delivered": 10, "last_delivery": time.time(),
            "prompt_tokens": 100, "decode_tokens": 10, "requests": 1, "cancelled": 0,
            "rank": None, "host": "mac1"}
    heartbeat.write_text(json.dumps(beat))
    metrics_port = free_port()
    with FakeServer() as server:
        config = tmp_path / "watch.toml"
        config.write_text(
            f'[instances.mac1]\nurl = "{server.url}"\ninterval = 0.2\n'
            f'heartbeat_file = "{heartbeat}"\nreport_dir = "{reports}"\n'
            'restart = { type = "none" }\n'
        )
        watch = WatchdogProcess(
            tmp_path, ["watch", "--config", str(config), "--metrics-port", str(metrics_port)])
        try:
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            _wait(lambda: "mlx_watchdog_up" in _served(url), 30, "the first probe in /metrics")
            # The counters follow the heartbeat: 40 more tokens, a new report.
            beat.update(beats=2, time=time.time(), decode_tokens=50, prompt_tokens=400)
            heartbeat.write_text(json.dumps(beat))
            (reports / "crash-1.json").write_text("{}")
            served = _wait(
                lambda: (s := _served(url))["mlx_watchdog_decode_tokens_total"].value == 40 and
                s["mlx_watchdog_crash_reports_total"].value == 1 and s,
                30, "the heartbeat's counters in /metrics")
            assert served["mlx_watchdog_prefill_tokens_total"].value == 300
            assert served["mlx_watchdog_in_flight"].value == 2
            # A restarted server (new pid) counts from zero: the total keeps growing.
            beat.update(pid=4343, beats=1, time=time.time(), decode_tokens=5)
            heartbeat.write_text(json.dumps(beat))
            _wait(lambda: _served(url)["mlx_watchdog_decode_tokens_total"].value == 45,
                  30, "the total to carry over a server restart")
            # `status` gets the same: throughput and the newest report, per instance.
            record = _wait(
                lambda: (r := watch.record("mac1")).get("newest_report") and
                (r.get("server") or {}).get("decode_tok_s") is not None and r,
                30, "throughput in the state file")
            assert record["server"]["in_flight"] == 2
            assert record["newest_report"]["file"] == str(reports / "crash-1.json")
            assert isinstance(record["last_ok_probe"], float)
        finally:
            watch.cleanup()
    used = set()
    for text in [RULES.read_text(), *_dashboard_exprs()]:
        used |= set(_METRIC.findall(text))
    assert len(used) >= 8
    missing = sorted(used - set(served))
    assert not missing, f"named by monitoring/ but not served by the exporter: {missing}"
