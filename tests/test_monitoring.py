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

from mlx_watchdog import contract

from harness.fakeserver import FakeServer
from harness.server import free_port
from harness.watchdog_run import WatchdogProcess

MONITORING = Path(__file__).resolve().parents[1] / "monitoring"
RULES = MONITORING / "alerts.yml"
RULE_TESTS = MONITORING / "alerts-test.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
_METRIC = re.compile(r"\bmlx_watchdog_[a-z_]+")


def _promtool() -> str:
    return _debian_tool("promtool")


def _debian_tool(name: str) -> str:
    """A command from Debian's prometheus package: CI installs it, and fails
    rather than skips without it."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is missing: .ci/run installs Debian's prometheus package")
        pytest.skip(f"{name} not installed (apt-get install prometheus); CI installs it")
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=MONITORING, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules():
    result = _run(_promtool(), "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 11 rules found" in result.stdout


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
            "rank": None, "host": "mac1",
            "memory": {"rss": 300 << 20, "mlx_active": 200 << 20, "prompt_cache_bytes": 0}}
    heartbeat.write_text(json.dumps(beat))
    metrics_port = free_port()
    with FakeServer() as server:
        config = tmp_path / "watch.toml"
        config.write_text(
            f'[instances.mac1]\nurl = "{server.url}"\ninterval = 0.2\n'
            f'heartbeat_file = "{heartbeat}"\nreport_dir = "{reports}"\n'
            'memory_limit = "16G"\nrestart = { type = "none" }\n'
        )
        watch = WatchdogProcess(
            tmp_path, ["watch", "--config", str(config), "--metrics-port", str(metrics_port)])
        try:
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            _wait(lambda: "mlx_watchdog_up" in _served(url), 30, "the first probe in /metrics")
            # The counters follow the heartbeat: 40 more tokens, a new report.
            beat.update(beats=2, time=time.time(), decode_tokens=50, prompt_tokens=400)
            heartbeat.write_text(json.dumps(beat))
            report = contract.report_name("died", 4242, time.time())  # the shim's naming
            (reports / report).write_text(json.dumps({"instance": {"name": "mac1"}}))
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
            assert record["newest_report"]["file"] == str(reports / report)
            assert isinstance(record["last_ok_probe"], float)
        finally:
            watch.cleanup()
    used = set()
    for text in [RULES.read_text(), *_dashboard_exprs()]:
        used |= set(_METRIC.findall(text))
    assert len(used) >= 8
    missing = sorted(used - set(served))
    assert not missing, f"named by monitoring/ but not served by the exporter: {missing}"


# -- every rule and panel against a real Prometheus scraping a real watchdog ---------------

_SELECTOR = re.compile(r"\b(mlx_watchdog_[a-z_]+)(\{[^}]*\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!=|!~|=)\s*"([^"]*)"')


def _prometheus() -> str:
    return _debian_tool("prometheus")


def _grafana_to_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables filled in as Grafana would."""
    return expr.replace("$instance", ".*").replace("$__rate_interval", "1m")


def _shipped_queries() -> list:
    """(where, PromQL) for every alert rule and every dashboard query."""
    import yaml

    queries = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            queries.append((f"alert {rule['alert']}", rule["expr"]))
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queries.append((f"panel {panel['title']!r}", _grafana_to_promql(target["expr"])))
    for variable in dashboard["templating"]["list"]:
        if variable.get("type") == "query":
            label_values = re.fullmatch(r"label_values\((\w+), *(\w+)\)", variable["definition"])
            assert label_values, variable["definition"]
            queries.append((f"variable {variable['name']}", label_values.group(1)))
    return queries


def _query(prometheus: str, promql: str) -> dict:
    answer = requests.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=10)
    body = answer.json()
    assert body["status"] == "success", (promql, body)
    return body["data"]


@pytest.mark.server
def test_every_rule_and_panel_selects_series_scraped_from_a_real_watchdog(tmp_path, tiny_llama):
    """A real Prometheus scrapes `supervise --metrics-port` of a real shimmed
    stock server that served, died (a crash report, a restart) and served
    again. Every series selector of every shipped alert rule and dashboard
    query must select scraped series, every whole expression must evaluate,
    and every series the promtool tests feed by hand must be one the
    exporter really has (name, label names and values)."""
    import yaml

    from harness.watchdog_run import wait_serving
    from harness.server import base_env, python_for
    from tests.conftest import fault_env

    binary = _prometheus()
    port, metrics_port, web_port = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    reports = tmp_path / "reports"
    arm = tmp_path / "arm"
    env = base_env(shim=False)
    env.update(fault_env("raise:resource:decode", arm, shim=False))
    sup = WatchdogProcess(tmp_path, [
        "supervise", "--name", "mac1", "--metrics-port", str(metrics_port),
        "--report-dir", str(reports), "--probe-interval", "1", "--probe-timeout", "5",
        "--boot-grace", "60", "--memory-limit", "64G", "--",
        str(python_for("0.32.2")), "-m", "mlx_lm", "server", "--model", str(tiny_llama),
        "--host", "127.0.0.1", "--port", str(port)], env=env)
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "mlx-watchdog", "honor_labels": True,
                            "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}],
    }))
    prometheus_log = open(tmp_path / "prometheus.log", "wb")
    server = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{web_port}"],
        stdout=prometheus_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True)
    prometheus = f"http://127.0.0.1:{web_port}"
    try:
        wait_serving(url, 180, log=sup)
        sup.wait_event(lambda e: e.get("state") == "healthy", 60, "a healthy probe")
        # Served work for the token counters, then a death: exit 70, a crash
        # report, a restart, and service again.
        for _ in range(3):
            wait_serving(url, 60, log=sup)
        arm.touch()
        sup.wait_event(lambda e: e["event"] == "restart", 120, "the restart after the death")
        arm.unlink()
        wait_serving(url, 180, log=sup)
        sup.wait_for(lambda: any(r.name.endswith(".json") for r in reports.iterdir()), 30,
                     "the shim's crash report")
        # Prometheus has scraped all of it: the restart and the report.
        _wait(lambda: _query(prometheus, 'mlx_watchdog_restarts_total{reason="exited"} > 0'
                             )["result"] and
              _query(prometheus, "mlx_watchdog_crash_reports_total > 0")["result"] and
              _query(prometheus, 'mlx_watchdog_state{state="healthy"} == 1')["result"],
              90, "the restart, the report and health in Prometheus")

        empty = []
        for where, promql in _shipped_queries():
            _query(prometheus, promql)  # the whole expression evaluates
            for name, matchers in _SELECTOR.findall(promql):
                selector = name + matchers
                if not _query(prometheus, selector)["result"]:
                    empty.append(f"{where}: {selector}")
        assert not empty, "selects nothing in a real scrape:\n" + "\n".join(empty)

        # Prometheus itself evaluates every rule without error.
        rules = requests.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]
        for group in rules["groups"]:
            for rule in group["rules"]:
                assert rule["health"] in ("ok", "unknown"), rule

        # The promtool tests' hand-written series are shaped like real ones.
        scraped = _query(prometheus, '{__name__=~"mlx_watchdog_.*"}')["result"]
        real = {}
        for series in scraped:
            labels = dict(series["metric"])
            real.setdefault(labels.pop("__name__"), []).append(labels)
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
            for item in test["input_series"]:
                name, matchers = _SELECTOR.match(item["series"]).groups()
                wanted = dict((k, v) for k, _, v in _MATCHER.findall(matchers or ""))
                wanted.pop("instance", None)
                assert name in real, f"alerts-test.yml feeds {name}, which is never exported"
                assert any(all(labels.get(k) == v for k, v in wanted.items())
                           for labels in real[name]), (item["series"], real[name])
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        prometheus_log.close()
        sup.cleanup()
