"""probe.Probe against tiny in-process HTTP servers on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
from click.testing import CliRunner

from mlx_watchdog.cli import main
from mlx_watchdog.probe import OK, UNHEALTHY, UNREACHABLE, Probe, ProbeResult
from harness.fakeserver import (
    DEAD_THREAD,
    DRIBBLE_BODY,
    DRIBBLE_HEADERS,
    DROP,
    HANG,
    HEALTH_DEAD,
    FakeServer,
    json_answer,
)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(url: str, **kwargs) -> ProbeResult:
    return Probe(url, **{"timeout": 2.0, **kwargs})()


def test_ok_sends_one_ordinary_request():
    with FakeServer() as server:
        result = probe(server.url, model="my-model", api_key="k-123")
    assert result.status == OK and result.ok
    assert result.tokens == 1 and result.http_status == 200
    [(path, headers, body)] = server.requests
    assert path == "/v1/chat/completions"
    assert body == {
        "model": "my-model",
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
        "stream": False,
    }
    assert "seed" not in body  # a different seed drains mlx-lm's batch
    assert headers["Authorization"] == "Bearer k-123"
    # The shim's admission part never refuses nor queues a request that says so.
    assert headers["X-MLX-Watchdog-Probe"] == "1"


def test_no_authorization_header_without_a_key():
    with FakeServer() as server:
        assert probe(server.url).ok
    assert "Authorization" not in server.requests[0][1]


@pytest.mark.parametrize(
    "body",
    [
        {"choices": [{"message": {"content": "hi"}}]},  # no usage, content
        {"usage": {"completion_tokens": 1}, "choices": [{"message": {"content": ""}}]},
        {"choices": [{"text": "x"}]},  # /v1/completions shape
    ],
)
def test_tokens_from_usage_or_content(body):
    with FakeServer(completion=json_answer(200, body)) as server:
        assert probe(server.url).ok


@pytest.mark.parametrize(
    "answer, reason",
    [
        ((200, b"<html>garbage"), "malformed"),
        ((200, b'["a list"]'), "malformed"),
        (json_answer(200, {"usage": {"completion_tokens": 0}}), "without any tokens"),
        (json_answer(200, {"choices": [{"message": {"content": ""}}]}), "without any tokens"),
        (json_answer(500, {"error": "boom"}), "HTTP 500: boom"),
        ((502, b"Bad gateway"), "HTTP 502: Bad gateway"),
        (json_answer(400, {"error": {"message": "bad model"}}), "HTTP 400: bad model"),
        ((404, b"Not Found"), "HTTP 404: Not Found"),
    ],
)
def test_wrong_answers_are_unhealthy(answer, reason):
    with FakeServer(completion=answer) as server:
        result = probe(server.url)
    assert result.status == UNHEALTHY
    assert reason in result.reason
    assert not result.dead_thread


def test_the_shims_busy_503_is_read_as_shedding_with_its_last_delivery():
    busy = {"error": {"message": "the server is busy: 2 requests already wait for 1 slot",
                      "type": "server_busy", "code": 503, "reason": "queue_full"},
            "queued": 2, "running": 1, "last_delivery_age_s": 0.25}
    with FakeServer(completion=json_answer(503, busy)) as server:
        result = probe(server.url)
    assert result.status == UNHEALTHY and result.http_status == 503
    assert result.shedding and result.last_delivery_age_s == 0.25 and not result.dead_thread
    assert "the server is busy" in result.reason
    other = dict(busy, error=dict(busy["error"], type="server_error"))
    for answer in (json_answer(503, other), json_answer(500, busy), json_answer(503, {})):
        with FakeServer(completion=answer) as server:
            result = probe(server.url)
        assert not result.shedding and result.last_delivery_age_s is None, answer


def test_dead_thread_404_is_flagged():
    with FakeServer(completion=DEAD_THREAD) as server:
        result = probe(server.url)
    assert result.status == UNHEALTHY and result.http_status == 404
    assert result.dead_thread
    assert "generation thread died" in result.reason


def test_health_503_is_a_dead_thread_and_skips_the_completion():
    with FakeServer(health=HEALTH_DEAD) as server:
        result = probe(server.url, check_health=True)
    assert result.status == UNHEALTHY and result.http_status == 503 and result.dead_thread
    assert server.requests == []


def test_health_check_is_off_by_default_and_a_missing_health_is_ignored():
    with FakeServer(health=HEALTH_DEAD) as server:
        assert probe(server.url).ok
    with FakeServer(health=(404, b"Not Found")) as server:
        assert probe(server.url, check_health=True).ok


def test_connection_refused_is_unreachable():
    result = probe(f"http://127.0.0.1:{closed_port()}")
    assert result.status == UNREACHABLE
    assert "Connection refused" in result.reason


def test_dropped_connection_is_unhealthy():
    with FakeServer(completion=DROP) as server:
        result = probe(server.url)
    assert result.status == UNHEALTHY and result.http_status is None
    assert "connection broken" in result.reason


def test_a_hung_server_times_out():
    with FakeServer(completion=HANG) as server:
        result = probe(server.url, timeout=0.5)
    assert result.status == UNHEALTHY and "timed out after 0.5s" in result.reason
    assert result.http_status is None


@pytest.mark.parametrize("behaviour", [DRIBBLE_BODY, DRIBBLE_HEADERS])
def test_slow_loris_is_bounded_by_the_total_timeout(behaviour):
    # Each read gets a byte within the per-read timeout; only a total
    # deadline stops this. Bound generously: the point is "not forever".
    outcome = []
    with FakeServer(completion=behaviour) as server:
        worker = threading.Thread(target=lambda: outcome.append(probe(server.url, timeout=0.5)))
        worker.start()
        worker.join(timeout=20)
        assert not worker.is_alive(), "the probe hung past its total timeout"
    [result] = outcome
    assert result.status == UNHEALTHY and "timed out" in result.reason


def test_body_size_is_capped():
    huge = json_answer(200, {"choices": [{"message": {"content": "x" * 5000}}]})
    with FakeServer(completion=huge) as server:
        result = probe(server.url, max_body=1000)
    assert result.status == UNHEALTHY and "larger than 1000 bytes" in result.reason


def test_never_raises_on_a_nonsense_url():
    assert probe("not a url").status in (UNHEALTHY, UNREACHABLE)
    assert probe("http://").status in (UNHEALTHY, UNREACHABLE)


def test_timeout_covers_health_and_completion_together():
    # /health hangs: the completion is never tried, the probe ends on time.
    with FakeServer(health=HANG) as server:
        started = time.monotonic()
        result = probe(server.url, timeout=0.5, check_health=True)
        assert time.monotonic() - started < 15
    assert "timed out" in result.reason and server.requests == []


# -- the CLI ---------------------------------------------------------------


def run_probe_cli(*args: str, env=None):
    return CliRunner().invoke(main, ["probe", "--timeout", "2", *args], env=env)


def test_cli_healthy_exits_0_with_one_json_line():
    with FakeServer() as server:
        result = run_probe_cli("--url", server.url)
    assert result.exit_code == 0, result.output
    line = json.loads(result.output)
    assert set(line) == {"status", "latency_s", "tokens", "reason"}
    assert line["status"] == "ok" and line["tokens"] == 1


def test_cli_unhealthy_exits_1():
    with FakeServer(completion=DEAD_THREAD) as server:
        result = run_probe_cli("--url", server.url)
    assert result.exit_code == 1
    assert json.loads(result.output)["status"] == "unhealthy"


def test_cli_unreachable_exits_2():
    result = run_probe_cli("--url", f"http://127.0.0.1:{closed_port()}")
    assert result.exit_code == 2
    assert json.loads(result.output)["status"] == "unreachable"


def test_cli_api_key_from_the_environment():
    with FakeServer() as server:
        result = run_probe_cli("--url", server.url, env={"MLX_WATCHDOG_API_KEY": "env-key-9"})
    assert result.exit_code == 0
    assert server.requests[0][1]["Authorization"] == "Bearer env-key-9"
    assert "env-key-9" not in result.output


def test_cli_model_flag():
    with FakeServer() as server:
        run_probe_cli("--url", server.url, "--model", "mlx-community/x")
    assert server.requests[0][2]["model"] == "mlx-community/x"



def test_a_path_prefix_in_the_url_is_kept():
    with FakeServer() as server:
        assert probe(server.url + "/mlx/").ok
    assert server.requests[0][0] == "/mlx/v1/chat/completions"


def test_a_silent_tls_server_is_bounded_by_the_total_timeout():
    # Accepts the TCP connection, never says a word: the TLS handshake waits.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        started = time.monotonic()
        result = probe(f"https://127.0.0.1:{port}", timeout=0.5)
        assert time.monotonic() - started < 15
    assert result.status == UNHEALTHY and "timed out" in result.reason


def test_tls_to_a_plain_http_server_is_unhealthy():
    with FakeServer() as server:
        result = probe(server.url.replace("http:", "https:"))
    assert result.status == UNHEALTHY and "TLS" in result.reason


def test_cli_health_flag():
    with FakeServer(health=HEALTH_DEAD) as server:
        assert run_probe_cli("--url", server.url).exit_code == 0
        result = run_probe_cli("--url", server.url, "--health")
    assert result.exit_code == 1 and "/health: 503" in result.output


# -- the shim's warning about a known-bad install (issue 12) -----------------

BAD_PAIR = ("mlx-lm 0.31.0 with mlx 0.32.4: the generation thread dies on the first request "
            "(There is no Stream(cpu, 0) in current thread); fix: pip install 'mlx<0.32'")


def test_the_warning_in_health_is_kept_whatever_the_completion_says():
    health = json_answer(200, {"status": "ok", "warning": BAD_PAIR + "\n\x1b[31m"})
    with FakeServer(health=health, completion=HANG) as server:
        result = probe(server.url, timeout=0.5, check_health=True)
    assert result.status == UNHEALTHY and "timed out" in result.reason
    assert result.warning == BAD_PAIR + " \\x1b[31m"  # one line, escapes shown


def test_the_warning_in_a_shim_error_answer_is_read_without_health():
    died = json_answer(503, {"error": {"message": "generation thread died (RuntimeError: x)"},
                             "warning": BAD_PAIR})
    with FakeServer(completion=died) as server:
        result = probe(server.url)
    assert result.status == UNHEALTHY and result.warning == BAD_PAIR


def test_no_warning_from_a_plain_server():
    with FakeServer(completion=DEAD_THREAD) as server:
        assert probe(server.url, check_health=True).warning is None


def test_cli_prints_the_warning_in_the_json_line_and_on_stderr():
    health = json_answer(200, {"status": "ok", "warning": BAD_PAIR})
    with FakeServer(health=health) as server:
        result = run_probe_cli("--url", server.url, "--health")
        plain = run_probe_cli("--url", server.url)
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout)
    assert line["status"] == "ok" and line["warning"] == BAD_PAIR
    assert result.stderr.strip().splitlines() == [f"WARNING: {BAD_PAIR}"]
    assert "warning" not in json.loads(plain.stdout) and plain.stderr == ""


def test_other_evidence_can_end_the_wait_before_the_timeout():
    # The monitor hands the probe a give_up check (the shim's heartbeat gone
    # stale): a probe sent just before a hang stops waiting once that is so,
    # instead of holding the verdict for its whole timeout.
    asked = []

    def give_up():
        asked.append(time.monotonic())
        return "the heartbeat is 12s old (limit 10s)" if len(asked) >= 2 else None

    with FakeServer(completion=HANG) as server:
        result = Probe(server.url, timeout=60, give_up=give_up)()
    assert result.status == UNHEALTHY and result.latency_s < 30  # not the 60 s timeout
    assert result.reason.startswith("no answer after ") and "heartbeat is 12s old" in result.reason
    with FakeServer(completion=HANG) as server:  # no reason given: the timeout stands
        result = Probe(server.url, timeout=1.5, give_up=lambda: None)()
    assert result.reason == "timed out after 1.5s"


def test_a_probe_that_stops_waiting_for_a_sent_request_says_it_abandoned_it():
    with FakeServer(completion=HANG) as server:  # the request is sent, never answered
        hung = Probe(server.url, timeout=1.0)()
    assert hung.status == UNHEALTHY and hung.abandoned
    unreachable = Probe("http://127.0.0.1:9", timeout=1.0)()  # nothing was sent
    assert not unreachable.abandoned
    with FakeServer() as server:
        assert not Probe(server.url, timeout=5.0)().abandoned


def test_the_heartbeat_check_gives_up_only_on_a_stale_serving_or_stalled_beat(tmp_path):
    from mlx_watchdog.compose import _stale_heartbeat
    from mlx_watchdog.heartbeat import HeartbeatTracker

    path = tmp_path / "heartbeat.json"
    tracker = HeartbeatTracker(path)
    why = _stale_heartbeat(tracker, 10.0, clock=lambda: 1000.0)
    assert why() is None  # no heartbeat
    for phase, age, stale in (("serving", 5, False), ("serving", 11, True),
                              ("loading", 99, False), ("stalled", 1, True)):
        path.write_text(json.dumps({"pid": os.getpid(), "beats": 1, "time": 1000.0 - age,
                                    "phase": phase}))
        tracker.sample()  # the monitor's tick: it accepts this writer
        assert bool(why()) is stale, (phase, age)
    path.write_text(json.dumps({"pid": os.getpid() + 1, "beats": 1, "time": 1.0,
                                "phase": "stalled"}))
    assert why() is None  # not the writer the monitor accepted


def test_the_heartbeat_check_leaves_the_tracker_to_the_monitor_thread(tmp_path):
    # The probe's give-up thread runs beside the monitor's: it reads the file
    # itself and never samples (nor resets) the monitor's tracker.
    from mlx_watchdog.compose import _stale_heartbeat
    from mlx_watchdog.group_heartbeats import GroupHeartbeat
    from mlx_watchdog.heartbeat import HeartbeatTracker

    path = tmp_path / "heartbeat.json"
    path.write_text(json.dumps({"pid": os.getpid(), "beats": 1, "time": time.time() - 30,
                                "phase": "serving"}))
    def state(tracker) -> dict:
        inner = getattr(tracker, "_trackers", {})
        return {"self": {k: repr(v) for k, v in vars(tracker).items()},
                **{name: {k: repr(v) for k, v in vars(t).items()} for name, t in inner.items()}}

    for tracker in (HeartbeatTracker(path), GroupHeartbeat(path)):
        tracker.sample()
        before = state(tracker)
        assert "30s old" in _stale_heartbeat(tracker, 10.0)()
        assert state(tracker) == before




def test_a_url_ending_in_v1_is_the_server_root():
    from mlx_watchdog.probe import check_url

    # What every OpenAI client config holds; the probe adds /v1/... itself.
    assert check_url("http://127.0.0.1:8080/v1") == "http://127.0.0.1:8080"
    assert check_url("http://127.0.0.1:8080/v1/") == "http://127.0.0.1:8080"
    assert check_url("https://proxy.lan/mlx/v1") == "https://proxy.lan/mlx"
    assert check_url("http://127.0.0.1:8080/v1beta") == "http://127.0.0.1:8080/v1beta"
