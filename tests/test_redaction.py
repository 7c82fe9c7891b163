"""The API key never shows in logs, status, the state file, metrics or reprs."""

from __future__ import annotations

import io
import json
import logging

import pytest
from click.testing import CliRunner

from mlx_watchdog.policy import RestartPolicy
from mlx_watchdog.cli import main
from mlx_watchdog.config import parse_config
from mlx_watchdog.judge import Judge, JudgeConfig
from mlx_watchdog.log import Events, setup_logging
from mlx_watchdog.metrics import Metrics
from mlx_watchdog.monitor import Monitor
from mlx_watchdog.probe import Probe
from mlx_watchdog.redact import Secret, redact_url
from mlx_watchdog.state import StateStore
from mlx_watchdog.watch import build_watched_server_monitor
from harness.fakeserver import FakeServer, json_answer

KEY = "sk-live-Zq81xTopSecret"


def echo_the_key(body):
    # A careless proxy that repeats the credential in its error message.
    return json_answer(401, {"error": f"invalid key {KEY}"})


def test_secret_hides_itself():
    secret = Secret(KEY)
    assert KEY not in repr(secret) and KEY not in str(secret) and KEY not in f"{secret}"
    assert secret.reveal() == KEY
    with pytest.raises(TypeError):
        json.dumps({"key": secret})


def test_probe_repr():
    text = repr(Probe("http://127.0.0.1:8080", api_key=KEY))
    assert KEY not in text and "api_key='***'" in text


def test_config_repr():
    config = parse_config(
        {"instances": {"a": {"url": "http://127.0.0.1:8080", "api_key": KEY,
                             "restart": {"type": "none"}}}}
    )
    assert KEY not in repr(config) and KEY not in str(config.instances[0])
    assert build_watched_server_monitor(config.instances[0]).probe.api_key.reveal() == KEY


def test_redact_url():
    assert redact_url("http://bob:pa55@host:8080/x") == "http://bob:***@host:8080/x"
    assert redact_url("http://host:8080") == "http://host:8080"


def test_key_is_sent_but_nowhere_recorded(tmp_path):
    for fmt in ("json", "text"):
        stream = io.StringIO()
        setup_logging(fmt, stream, level=logging.DEBUG)
        state_path = tmp_path / f"state-{fmt}.json"
        try:
            with FakeServer(completion=echo_the_key) as server:
                monitor = Monitor(
                    "gemma",
                    Probe(server.url, api_key=KEY, timeout=2),
                    judge=Judge(JudgeConfig(failures=1)),
                    policy=RestartPolicy(boot_grace_s=0),
                    action=None,
                    url=server.url,
                    metrics=Metrics(),
                    state=StateStore(state_path),
                )
                monitor.started()
                verdict = monitor.tick()
                Events("gemma").info("oops", f"a careless message with {KEY}")
        finally:
            setup_logging("text")
        assert server.requests[0][1]["Authorization"] == f"Bearer {KEY}"
        assert "invalid key ***" in verdict.reason
        assert KEY not in verdict.reason
        assert KEY not in stream.getvalue() and "***" in stream.getvalue()
        assert KEY not in state_path.read_text()
        assert KEY not in monitor.metrics.render().decode()
        status = CliRunner().invoke(main, ["status", "--json", "--state-file", str(state_path)])
        # Exit 1: the instance is not serving (the server answers 401).
        assert status.exit_code == 1 and KEY not in status.output


def test_probe_cli_output(tmp_path):
    with FakeServer(completion=echo_the_key) as server:
        result = CliRunner().invoke(
            main, ["probe", "--url", server.url, "--timeout", "2"],
            env={"MLX_WATCHDOG_API_KEY": KEY},
        )
    assert result.exit_code == 1
    assert KEY not in result.output and "invalid key ***" in result.output
