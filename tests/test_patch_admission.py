"""admission: a bounded queue, a queue deadline, a request deadline, and
queued apart from running. Real stock 0.31.3 and 0.32.2 servers with one slot
(--decode-concurrency 1 --prompt-concurrency 1: stock's batch is the larger of
the two), stock (the part off) as the control in the same run. Decode steps
are counted by the fault injector (MLX_TEST_DECODE_COUNT_FILE); no timing is
asserted, only what was generated when, and in what order answers came.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time

import openai  # scripts/setup-envs installs it: missing is a failure, not a skip
import pytest
import requests

from tests.conftest import FAULTS_DIR
from tests.test_watchdog_real import FAST, LOAD_S, server_command, watchdogs  # noqa: F401
from harness.procs import chat_body
from harness.server import (SHIM_DIR, VERSIONS, BackgroundRequest, free_port, run_python,
                            sse_events)
from harness.storm import burst, request_bytes
from harness.watchdog_run import wait_serving
from mlx_watchdog.judge import BUSY, Evidence, Judge
from mlx_watchdog.probe import ProbeResult, _read_completion

ONE_SLOT = ("--decode-concurrency", "1", "--prompt-concurrency", "1")
BUSY_TYPE = "server_busy"
HUGE = 100_000  # tokens: far more than any deadline here lets through


def _env(tmp_path, **extra):
    env = {"PYTHONPATH": "%s:%s" % (SHIM_DIR, FAULTS_DIR),
           "MLX_TEST_DECODE_COUNT_FILE": str(tmp_path / f"steps-{len(extra)}-{id(extra)}"),
           "MLX_HOTFIX_HEARTBEAT_FILE": str(tmp_path / f"heartbeat-{id(extra)}.json"),
           "MLX_HOTFIX_HEARTBEAT_INTERVAL": "0.2"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _steps(server) -> int:
    try:
        with open(server.env["MLX_TEST_DECODE_COUNT_FILE"]) as handle:
            return int(handle.read())
    except (OSError, ValueError):
        return 0


def _beat(server) -> dict:
    try:
        with open(server.env["MLX_HOTFIX_HEARTBEAT_FILE"]) as handle:
            return json.loads(handle.read())
    except (OSError, ValueError):
        return {}


def _wait(condition, what, server, timeout=120.0):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        log = server.log() if hasattr(server, "log") else server.text()
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{log[-3000:]}"
        time.sleep(0.02)


def _health(server) -> dict:
    response = requests.get(f"{server.url}/health", timeout=10)
    return dict(response.json(), http_status=response.status_code)


def _post(server, body, headers=None, timeout=120, stream=False):
    return requests.post(f"{server.url}/v1/chat/completions", json=body, headers=headers or {},
                         timeout=timeout, stream=stream)


def _assert_busy(status, headers, body, reason):
    assert status == 503, (status, body)
    assert int(headers["retry-after"]) >= 1, headers
    error = body["error"]
    assert error["type"] == BUSY_TYPE and error["code"] == 503 and error["reason"] == reason, body
    assert error["message"].startswith("the server is busy"), body


class _HealthWatcher:
    """Polls /health in the background; keeps every (status, queued, running) seen."""

    def __init__(self, server):
        self.server = server
        self.seen = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                body = _health(self.server)
                self.seen.add((body["http_status"], body.get("queued"), body.get("running")))
            except (requests.RequestException, ValueError):
                pass
            self._stop.wait(0.01)

    def stop(self):
        self._stop.set()
        self._thread.join(30)
        return self.seen


def _ask_and_hold(server, max_tokens=HUGE) -> socket.socket:
    """A non-streaming request whose client stays until the socket is closed."""
    return _ask_and_hold_at(server.port, max_tokens)


def _ask_and_hold_at(port, max_tokens=HUGE) -> socket.socket:
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(request_bytes(port, chat_body("a long story", max_tokens=max_tokens)))
    return client


# -- the storm: one slot, MLX_HOTFIX_MAX_QUEUE=2, 20 clients at once ----------------------


@pytest.mark.server
@pytest.mark.parametrize("version", VERSIONS)
def test_a_storm_on_one_slot_serves_three_and_refuses_the_rest_at_once(servers, tiny_llama,
                                                                       tmp_path, version):
    stock = servers(version, tiny_llama, args=ONE_SLOT,
                    env=_env(tmp_path, MLX_HOTFIX_MAX_QUEUE=2, MLX_HOTFIX_DISABLE="admission"))
    shimmed = servers(version, tiny_llama, args=ONE_SLOT,
                      env=_env(tmp_path, MLX_HOTFIX_MAX_QUEUE=2))
    stock.warm_up()
    shimmed.warm_up()
    assert ("admission applied (max queue 2, queue timeout off, request timeout off)"
            in shimmed.hotfix_lines()[0])
    assert "admission disabled" in stock.hotfix_lines()[0]

    # Stock, the control: all 20 wait; the last answer comes after the other
    # 19 were generated one after the other.
    before = _steps(stock)
    answers = burst(stock.port, 20, max_tokens=200, at_end=lambda: _steps(stock) - before)
    assert [a.status for a in answers] == [200] * 20, [a.error or a.body[:200] for a in answers]
    assert max(a.at_end for a in answers) >= 19 * 190, [a.at_end for a in answers]

    # The admission part: 1 running, 2 queued, 17 refused at once.
    watcher = _HealthWatcher(shimmed)
    answers = burst(shimmed.port, 20, max_tokens=200)
    seen = watcher.stop()
    served = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status != 200]
    assert len(served) == 3 and len(refused) == 17, [(a.status, a.body[:120]) for a in answers]
    for answer in served:
        assert answer.json()["usage"]["completion_tokens"] == 200
    for answer in refused:
        body = answer.json()
        _assert_busy(answer.status, answer.headers, body, "queue_full")
        # Refused while the three were still there: none waited for a slot.
        assert (body["queued"], body["running"]) == (2, 1), body
        assert "2 requests already wait for 1 slot (MLX_HOTFIX_MAX_QUEUE=2)" in body["error"][
            "message"]
    assert max(a.finished_at for a in refused) < max(a.finished_at for a in served)
    assert (200, 2, 1) in seen, seen  # /health: queued apart from running, and still 200
    assert {status for status, _, _ in seen} == {200}, seen
    beat = _wait(lambda: (_beat(shimmed) if _beat(shimmed).get("running") == 0 else None),
                 "the heartbeat after the storm", shimmed)
    assert beat["rejected_queue_full"] == 17 and beat["queued"] == 0, beat
    assert beat["rejected_queue_timeout"] == 0 and beat["deadline_stops"] == 0, beat
    assert beat["requests"] == 1 + 3, beat  # the warm-up and the three: stock saw no other
    line = "mlx-hotfix: admission: 17 requests refused (queue full) in the last 60 s"
    _wait(lambda: line in shimmed.hotfix_lines(), "the summary line", shimmed, timeout=30)
    assert "Traceback" not in shimmed.log()


# -- the queue deadline ------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize("version", VERSIONS)
def test_a_request_still_waiting_at_the_queue_timeout_is_refused_and_never_starts(
        servers, tiny_llama, tmp_path, version):
    server = servers(version, tiny_llama, args=ONE_SLOT,
                     env=_env(tmp_path, MLX_HOTFIX_QUEUE_TIMEOUT=2))
    server.warm_up()
    long = _ask_and_hold(server)
    _wait(lambda: _health(server).get("running") == 1, "the long request to run", server)
    waiting = BackgroundRequest(lambda: _post(server, chat_body("b", max_tokens=5000)),
                                name="waiting")
    _wait(lambda: _health(server).get("queued") == 1, "the second request to queue", server)
    assert waiting.join(120), waiting
    _assert_busy(waiting.status, waiting.response.headers, waiting.json(), "queue_timeout")
    assert "no slot came free within 2 s of waiting" in waiting.json()["error"]["message"]
    assert _health(server)["queued"] == 0

    # The long one's client leaves (the disconnect part stops it, within one
    # decode budget); then the next request runs. Had the refused one been
    # left in stock's queue, its 5000 tokens would come before the next one's 5.
    before = _steps(server)
    long.close()
    _wait(lambda: any("client hung up" in l for l in server.hotfix_lines()), "the hang-up", server)
    after = server.chat("c", max_tokens=5, timeout=120)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 5
    assert _steps(server) - before < 1000, (before, _steps(server))
    beat = _wait(lambda: (_beat(server) if _beat(server).get("requests") == 3 else None),
                 "the heartbeat", server)
    assert beat["rejected_queue_timeout"] == 1 and beat["rejected_queue_full"] == 0, beat
    _wait(lambda: "mlx-hotfix: admission: 1 request refused (queue timeout) in the last 60 s"
          in server.hotfix_lines(), "the summary line", server, timeout=30)

    # X-Request-Timeout alone sets a deadline (it lowers "none"); a bad one is named.
    cut = _post(server, chat_body("d", max_tokens=HUGE), headers={"X-Request-Timeout": "1"})
    assert cut.status_code == 200 and cut.json()["choices"][0]["finish_reason"] == "length"
    assert cut.json()["usage"]["completion_tokens"] < HUGE
    bad = _post(server, chat_body("e", max_tokens=5), headers={"X-Request-Timeout": "soon"})
    assert bad.status_code == 400 and "X-Request-Timeout: 'soon'" in bad.json()["error"]["message"]
    assert "Traceback" not in server.log()


# -- the request deadline ----------------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize("version", VERSIONS)
def test_a_request_past_its_deadline_ends_with_finish_reason_length(servers, tiny_llama,
                                                                    tmp_path, version):
    stock = servers(version, tiny_llama, args=ONE_SLOT,
                    env=_env(tmp_path, MLX_HOTFIX_REQUEST_TIMEOUT=2,
                             MLX_HOTFIX_DISABLE="admission"))
    server = servers(version, tiny_llama, args=ONE_SLOT,
                     env=_env(tmp_path, MLX_HOTFIX_REQUEST_TIMEOUT=2))
    stock.warm_up()
    server.warm_up()
    assert "request timeout 2 s" in server.hotfix_lines()[0]

    # Stock, the control: twice the deadline later, still streaming.
    sent = time.monotonic()
    with _post(stock, chat_body("long", max_tokens=HUGE, stream=True), stream=True) as response:
        chunks = 0
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[len(b"data: "):])
                assert chunk["choices"][0]["finish_reason"] is None, chunk
                chunks += 1
            if time.monotonic() - sent > 4:
                break
    assert chunks > 0

    plain = _post(server, chat_body("long", max_tokens=HUGE))
    assert plain.status_code == 200
    assert plain.json()["choices"][0]["finish_reason"] == "length"
    assert 0 < plain.json()["usage"]["completion_tokens"] < HUGE
    assert plain.json()["choices"][0]["message"]["content"]

    streamed = _post(server, chat_body("long", max_tokens=HUGE, stream=True), stream=True)
    events = sse_events(streamed.content)
    assert streamed.status_code == 200 and events[-1] == "[DONE]", events[-3:]
    assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2]
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2]), events[:3]

    # The header may lower the deadline, never raise it.
    raised = _post(server, chat_body("long", max_tokens=HUGE),
                   headers={"X-Request-Timeout": "3600"})
    assert raised.json()["choices"][0]["finish_reason"] == "length"
    assert raised.json()["usage"]["completion_tokens"] < HUGE

    # The cut requests hold no slot: the next one is served at once, not
    # after 100,000 tokens.
    before = _steps(server)
    after = server.chat("next", max_tokens=5, timeout=120)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 5
    assert _steps(server) - before < 1000, (before, _steps(server))
    beat = _wait(lambda: (lambda b: b if (b.get("deadline_stops"), b.get("running")) == (3, 0)
                          else None)(_beat(server)), "the heartbeat once idle", server)
    assert beat["queued"] == 0 and beat["rejected_queue_full"] == 0, beat
    _wait(lambda: any(l.startswith("mlx-hotfix: admission: ") and "stopped at the deadline" in l
                      for l in server.hotfix_lines()), "the summary line", server, timeout=30)
    assert "Traceback" not in server.log()


# -- an OpenAI client against a full queue; the probe never waits in line -----------------

SERVICE = 800  # tokens: seconds of work here, so the first attempt finds the queue full


@pytest.mark.server
@pytest.mark.parametrize("version", VERSIONS)
def test_an_openai_client_retries_after_retry_after_and_succeeds(servers, tiny_llama,
                                                                 tmp_path, version):
    server = servers(version, tiny_llama, args=ONE_SLOT, env=_env(tmp_path, MLX_HOTFIX_MAX_QUEUE=2))
    server.warm_up()
    # One request alone: the recent service time Retry-After is estimated from.
    assert server.chat("measure", max_tokens=SERVICE, timeout=300).status_code == 200
    attempts = []

    def record(response):
        attempts.append((time.monotonic(), response.status_code,
                         response.headers.get("retry-after")))

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed",
                           http_client=openai.DefaultHttpxClient(
                               event_hooks={"response": [record]}))
    fill = [BackgroundRequest(lambda i=i: _post(server, chat_body(f"fill {i}", max_tokens=SERVICE),
                                                timeout=300), name=f"fill-{i}")
            for i in range(3)]
    _wait(lambda: (_health(server)["queued"], _health(server)["running"]) == (2, 1),
          "a full queue", server)
    completion = client.chat.completions.create(  # default retries (2)
        model="default_model", messages=[{"role": "user", "content": "hello"}], max_tokens=5)
    assert completion.choices[0].message.content is not None
    assert completion.usage.completion_tokens == 5
    statuses = [status for _, status, _ in attempts]
    assert statuses[0] == 503 and statuses[-1] == 200 and len(statuses) <= 3, attempts
    for (at, status, retry_after), (next_at, _, _) in zip(attempts, attempts[1:]):
        assert status == 503 and int(retry_after) >= 1
        assert next_at - at >= int(retry_after) - 0.05, attempts  # it waited as told
    for request in fill:
        assert request.join(300) and request.status == 200, request
    assert "Traceback" not in server.log()


@pytest.mark.server
@pytest.mark.parametrize("version", VERSIONS)
def test_the_watchdogs_probe_is_never_refused_nor_queued_behind_the_line(servers, tiny_llama,
                                                                         tmp_path, version):
    server = servers(version, tiny_llama, args=ONE_SLOT, env=_env(tmp_path, MLX_HOTFIX_MAX_QUEUE=2))
    server.warm_up()
    holders = [_ask_and_hold(server)]  # one running, for as long as its client stays
    _wait(lambda: _health(server)["running"] == 1, "the first to run", server)
    holders += [_ask_and_hold(server) for _ in range(2)]
    _wait(lambda: _health(server)["queued"] == 2, "a full queue", server)
    probe_headers = {"X-MLX-Watchdog-Probe": "1"}
    # The header alone buys nothing: a longer request waits, or is refused, as any.
    pretender = _post(server, chat_body("me too", max_tokens=50), headers=probe_headers)
    _assert_busy(pretender.status_code, pretender.headers, pretender.json(), "queue_full")
    plain = _post(server, chat_body("ping", max_tokens=1))
    _assert_busy(plain.status_code, plain.headers, plain.json(), "queue_full")
    probe = BackgroundRequest(lambda: _post(server, chat_body("ping", max_tokens=1),
                                            headers=probe_headers), name="probe")
    # The probe is in no count, and went past the line to stock: it waits
    # there for the slot, not behind the two. (Only once it is there may the
    # slot free: had the running one left first, the slot would rightly go
    # to the first of the two, and the probe wait for its 100,000 tokens.)
    _wait(lambda: _health(server)["in_flight"] == 2, "the probe to reach stock", server)
    assert (_health(server)["queued"], _health(server)["running"]) == (2, 1)
    holders[0].close()  # the running one's client leaves: the slot frees
    assert probe.join(120) and probe.status == 200, probe
    assert probe.json()["usage"]["completion_tokens"] == 1
    # Then the line moves: the first of the two runs.
    _wait(lambda: (_health(server)["queued"], _health(server)["running"]) == (1, 1),
          "the line to move after the probe", server)
    for holder in holders[1:]:
        holder.close()
    beat = _wait(lambda: (lambda b: b if b.get("running") == 0 else None)(_beat(server)),
                 "the heartbeat once idle", server)
    assert beat["rejected_queue_full"] == 2, beat  # the pretender and the plain one
    assert "Traceback" not in server.log()


# -- settings ----------------------------------------------------------------------------


def test_bad_values_are_named_and_the_defaults_used(envs):
    result = run_python("0.31.3", "import mlx_lm.server",
                        env={"MLX_HOTFIX_MAX_QUEUE": "0", "MLX_HOTFIX_QUEUE_TIMEOUT": "nan",
                             "MLX_HOTFIX_REQUEST_TIMEOUT": "-3"})
    assert result.returncode == 0, result.stderr
    lines = [l for l in result.stderr.splitlines() if l.startswith("mlx-hotfix:")]
    assert lines[:3] == [
        "mlx-hotfix: MLX_HOTFIX_MAX_QUEUE='0' is not a whole number of requests from 1 to "
        "1000000; using no limit",
        "mlx-hotfix: MLX_HOTFIX_QUEUE_TIMEOUT='nan' is not a number of seconds above 0; "
        "using no limit",
        "mlx-hotfix: MLX_HOTFIX_REQUEST_TIMEOUT='-3' is not a number of seconds above 0; "
        "using no limit",
    ]
    assert ("; admission applied (max queue off, queue timeout off, request timeout off)"
            in lines[3]), lines


SETTINGS = textwrap.dedent("""
    import json
    from mlx_hotfix.config import Config
    from mlx_hotfix.admission import describe
    out = []
    for env in ({"MLX_HOTFIX_MAX_QUEUE": "two", "MLX_HOTFIX_QUEUE_TIMEOUT": "-1",
                 "MLX_HOTFIX_REQUEST_TIMEOUT": "0"},
                {"MLX_HOTFIX_MAX_QUEUE": "-2", "MLX_HOTFIX_QUEUE_TIMEOUT": "inf",
                 "MLX_HOTFIX_REQUEST_TIMEOUT": "soon"},
                {"MLX_HOTFIX_MAX_QUEUE": " 8 ", "MLX_HOTFIX_QUEUE_TIMEOUT": "30",
                 "MLX_HOTFIX_REQUEST_TIMEOUT": "1.5"}, {}):
        c = Config(env)
        out.append([c.warnings, describe(c.max_queue, c.queue_timeout, c.request_timeout)])
    print(json.dumps(out))
""")


def test_every_bad_setting_falls_back_to_no_limit():
    result = subprocess.run([sys.executable, "-c", SETTINGS], capture_output=True, text=True,
                            env={"PYTHONPATH": str(SHIM_DIR), "MLX_HOTFIX": "0"}, timeout=60)
    assert result.returncode == 0, result.stderr
    texts, words, good, unset = json.loads(result.stdout)
    off = "max queue off, queue timeout off, request timeout off"
    for warnings, described in (texts, words):
        assert len(warnings) == 3 and described == off, warnings
        assert all(w.endswith("; using no limit") for w in warnings), warnings
    assert texts[0][0] == ("MLX_HOTFIX_MAX_QUEUE='two' is not a whole number of requests "
                           "from 1 to 1000000; using no limit")
    assert "MLX_HOTFIX_QUEUE_TIMEOUT='inf' is not a number of seconds above 0" in words[0][1]
    assert good == [[], "max queue 8, queue timeout 30 s, request timeout 1.5 s"]
    assert unset == [[], off]


# -- the line itself (the shim's admission module, in a subprocess) ---------------------------

LOGIC = textwrap.dedent("""
    import json, threading
    from mlx_hotfix import admission as a

    out = {}
    said, timers = [], []
    now = [100.0]
    summary = a.Summary(say=said.append, clock=lambda: now[0],
                        timer=lambda delay, fn: timers.append((delay, fn)))
    gate = a.Gate(max_queue=2, summary=summary, clock=lambda: now[0])
    first = a.Ticket(now=now[0]); gate.admit(first)
    line = [a.Ticket(now=now[0]) for _ in range(2)]
    threads = [threading.Thread(target=gate.admit, args=(t,), daemon=True) for t in line]
    for queued, t in enumerate(threads, 1):  # one after the other: a known order
        t.start()
        while gate.counts() != (queued, 1):
            pass
    out["counts"] = gate.counts()
    try:
        gate.admit(a.Ticket(now=now[0]))
    except a.Refused as refused:
        out["refused"] = [refused.reason, refused.retry_after, refused.message]
    probe = a.Ticket(probe=True); gate.admit(probe)  # never refused, never counted
    out["with_probe"] = gate.counts()
    now[0] += 30.0
    gate.release(first)  # 30 s of service; the probe still holds the slot
    out["after_first"] = gate.counts()
    gate.release(probe)
    threads[0].join(5)
    out["order"] = [line[0].state, line[1].state]
    now[0] += 30.0
    gate.release(line[0]); gate.release(line[0])  # idempotent
    threads[1].join(5)
    out["after_release"] = gate.counts()
    # Retry-After: the waiting (at least one) times the recent service time.
    try:
        gate.max_queue = 0
        gate.admit(a.Ticket(now=now[0]))
    except a.Refused as refused:
        out["retry_after"] = refused.retry_after
    out["fields"] = gate.fields()
    out["timers"] = [d for d, _ in timers]
    timers[0][1](); out["said"] = list(said)
    gate.deadline_stop(); gate.deadline_stop()
    out["timers2"] = [d for d, _ in timers]
    now[0] += 5.0; timers[1][1](); out["said2"] = said[1:]
    out["describe"] = a.describe(2, 2.0, None)
    out["header"] = a.parse_timeout_header(" 1.5 ")
    bad = []
    for raw in ("0", "-1", "nan", "inf", "soon", ""):
        try:
            a.parse_timeout_header(raw)
        except ValueError as exc:
            bad.append(str(exc))
    out["bad"] = bad
    print(json.dumps(out))
""")


def test_the_line_is_first_come_first_served_and_says_itself_once_a_minute():
    result = subprocess.run([sys.executable, "-c", LOGIC], capture_output=True, text=True,
                            env={"PYTHONPATH": str(SHIM_DIR), "MLX_HOTFIX": "0"}, timeout=60)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["counts"] == [2, 1]
    reason, retry_after, message = out["refused"]
    assert reason == "queue_full" and retry_after >= 1
    assert message.startswith("the server is busy: 2 requests already wait for 1 slot")
    assert out["with_probe"] == [2, 1]
    assert out["after_first"] == [2, 0]  # the probe holds the one slot: nobody starts yet
    assert out["order"] == ["running", "waiting"]  # first come, first served
    assert out["after_release"] == [0, 1]
    assert out["retry_after"] == 30  # one waiting x 30 s of service / 1 slot
    assert out["fields"] == {"queued": 0, "running": 1, "rejected_queue_full": 2,
                             "rejected_queue_timeout": 0, "deadline_stops": 0}
    # One line for the burst, a second after it; the next waits out the minute.
    assert out["timers"] == [1.0]
    assert out["said"] == ["admission: 2 requests refused (queue full) in the last 60 s"]
    assert out["timers2"] == [1.0, 60.0]
    assert out["said2"] == ["admission: 2 requests stopped at the deadline in the last 60 s"]
    assert out["describe"] == "max queue 2, queue timeout 2 s, request timeout off"
    assert out["header"] == 1.5
    assert len(out["bad"]) == 6 and all(b.startswith("X-Request-Timeout: ") for b in out["bad"])


# -- the watchdog under the storm ----------------------------------------------------------



def _scrape(port: int) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "instance"))):
            s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.server
@pytest.mark.parametrize("version", VERSIONS)
def test_the_watchdog_never_restarts_a_server_that_is_busy_and_shedding(watchdogs, tiny_llama,
                                                                        tmp_path, version):
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    sup = watchdogs(["supervise", *FAST, "--metrics-port", str(metrics_port), "--",
                     *server_command(version, tiny_llama, port, *ONE_SLOT)],
                    env={"MLX_HOTFIX_MAX_QUEUE": "2"})
    wait_serving(url, LOAD_S, log=sup)
    sup.wait_event(lambda e: e.get("state") == "healthy", 60, "a healthy probe")
    child = sup.current_child()

    # Storm after storm for a while (every probe, 1 s apart, meets one), and
    # one plain request in the middle of each, judged as the probe would be.
    refused = 0
    verdicts = []
    started = time.monotonic()
    for _ in range(12):
        storm = BackgroundStorm(port)
        _wait(lambda: _health_at(url).get("queued") == 2, "a full queue", sup)
        verdicts.append(_judged_plain_request(url))
        answers = storm.join()
        refused += sum(1 for a in answers if a.status == 503)
        assert {a.status for a in answers} <= {200, 503}, [a.body[:200] for a in answers]
        if time.monotonic() - started > 10:
            break
    assert refused >= 17
    # A refused plain request carries its evidence: busy and shedding, tokens flowing.
    judged = [v for v in verdicts if v is not None]
    assert judged and all(v.state == BUSY for v in judged), verdicts

    # The counts reach the state file, `status` and the metrics: one running
    # and two queued, kept so until their clients leave (100,000 tokens each:
    # none ends by itself while the counts are read).
    hold = [_ask_and_hold_at(port)]
    _wait(lambda: _health_at(url).get("running") == 1, "the first to run", sup)
    hold += [_ask_and_hold_at(port) for _ in range(2)]
    server = sup.wait_for(lambda: (sup.record().get("server") or {}) if (
        (sup.record().get("server") or {}).get("queued") == 2) else None, 120,
        "the state file to show the queue")
    assert server["running"] == 1, server
    status = subprocess.run([sys.executable, "-m", "mlx_watchdog", "status", "--state-file",
                             str(sup.state_path)], capture_output=True, text=True, timeout=60)
    assert ", 1 running, 2 queued" in status.stdout, status.stdout
    refused += len(judged)  # the plain requests were refused too
    # The gauges follow the heartbeat a tick later than the state file can.
    samples = sup.wait_for(lambda: (lambda s: s if (
        s.get(("mlx_watchdog_rejected_total", (("reason", "queue_full"),))) == refused
        and s.get(("mlx_watchdog_queued", ())) == 2
        and s.get(("mlx_watchdog_running", ())) == 1) else None)(
        _scrape(metrics_port)), 60, "the refusals and the held counts in the metrics")
    assert samples[("mlx_watchdog_rejected_total", (("reason", "queue_timeout"),))] == 0
    assert samples[("mlx_watchdog_deadline_stops_total", ())] == 0
    for client in hold:
        client.close()  # the disconnect part stops each (the queued ones once they run)
    _wait(lambda: (_health_at(url).get("running"), _health_at(url).get("queued")) == (0, 0),
          "the held requests to end with their clients", sup)

    states = [e["state"] for e in sup.events() if e["event"] == "state"]
    assert not {"failing", "wedged", "down"} & set(states), states
    assert [e for e in sup.events() if e["event"] == "restart"] == [], sup.tail()
    assert sup.record()["restarts"] == 0 and sup.child_pids() == [child]
    assert sup.terminate() == 0


class BackgroundStorm:
    def __init__(self, port):
        self.answers = []
        self._thread = threading.Thread(
            target=lambda: self.answers.extend(burst(port, 20, max_tokens=200)), daemon=True)
        self._thread.start()

    def join(self):
        self._thread.join(600)
        return self.answers


def _health_at(url):
    try:
        return requests.get(f"{url}/health", timeout=10).json()
    except (requests.RequestException, ValueError):
        return {}


def _judged_plain_request(url):
    """A one-token request without the probe header; if refused, the judge's
    verdict on it as a probe result (no heartbeat, no CPU figure)."""
    response = requests.post(f"{url}/v1/chat/completions", timeout=120,
                             json=chat_body("ping", max_tokens=1))
    if response.status_code != 503:
        return None
    probe = ProbeResult(latency_s=0.01, **_read_completion(503, response.content))
    assert probe.shedding, probe
    return Judge().observe(Evidence(probe=probe, now=0.0, process_alive=None))
