"""exit: a dead generation thread answers every client, then exits 70.

Real stock servers (0.31.3: death reaches threading.excepthook; 0.32.2:
stock catches it and lives on), tiny generated model, CPU. Faults come from
harness/faults, armed after warm-up.
"""

from __future__ import annotations

import json
import socket
import textwrap

import pytest
import requests

from tests.conftest import fault_env
from harness.server import VERSIONS, BackgroundRequest, run_python, sse_events

CLIENT_TIMEOUT = 60  # far above the 1 s grace: a client that hits it was left waiting


def _answered(request: BackgroundRequest) -> None:
    assert request.join(CLIENT_TIMEOUT + 10), f"{request} never returned"
    assert not isinstance(request.error, requests.Timeout), f"{request} was left waiting"


def _plain_outcome(request: BackgroundRequest) -> str:
    """'completed' or 'error' (a 503 with the JSON error); anything else fails."""
    _answered(request)
    if request.status == 200:
        assert request.json()["choices"][0]["finish_reason"] in ("length", "stop"), request
        return "completed"
    _assert_503_json(request)
    return "error"


def _stream_outcome(request: BackgroundRequest) -> str:
    _answered(request)
    assert request.error is None, request
    events = sse_events(request.body)
    if request.status == 200 and events and events[-1] == "[DONE]":
        return "completed"
    _assert_stream_ends_with_error(request)
    return "error"


def _assert_503_json(request: BackgroundRequest) -> None:
    _answered(request)
    assert request.status == 503, request
    error = request.json()["error"]
    assert error["code"] == 503 and "generation thread died" in error["message"]


def _assert_stream_ends_with_error(request: BackgroundRequest) -> None:
    _answered(request)
    assert request.error is None, request
    events = sse_events(request.body)
    if request.status == 200:  # headers were out: the last event is the error
        assert isinstance(events[-1], dict) and "error" in events[-1], events[-3:]
        assert events[-1]["error"]["code"] == 503
    else:  # died before the stream started
        assert request.status == 503, request


# Every death mode users reported upstream, where it strikes: (fault, the
# line the shim must print: the death's class, then the exception). The faults raise the real messages
# (harness/faults); the natural `extend` crash is in test_patch_extend.
DEATHS = {
    "typeerror-prefill": ("raise:typeerror:prefill:1", "extend: TypeError: 'NoneType' object is not iterable"),
    "typeerror-decode": ("raise:typeerror:decode:2", "extend: TypeError: 'NoneType' object is not iterable"),
    "resource-prefill": ("raise:resource:prefill:1",
                         "metal-buffer-count: RuntimeError: [metal::malloc] Resource limit (499000) exceeded."),
    "resource-decode": ("raise:resource:decode:2",
                        "metal-buffer-count: RuntimeError: [metal::malloc] Resource limit (499000) exceeded."),
    "slice-prefill": ("raise:slice:prefill:1", "slice: ValueError: Slice indices must be 32-bit integers."),
    "slice-decode": ("raise:slice:decode:2", "slice: ValueError: Slice indices must be 32-bit integers."),
    "broadcast-prefill": ("raise:broadcast:prefill:1", "broadcast: ValueError: [broadcast_shapes] Shapes"),
    "broadcast-decode": ("raise:broadcast:decode:2", "broadcast: ValueError: [broadcast_shapes] Shapes"),
    "extract_cache-prefill": ("raise:extract:extract_cache:0", "extract: IndexError: list index out of range"),
    "extract_cache-decode": ("raise:extract:extract_cache:20", "extract: IndexError: list index out of range"),
}


@pytest.mark.server
@pytest.mark.parametrize("death", list(DEATHS))
@pytest.mark.parametrize("version", VERSIONS)
def test_death_answers_every_client_then_exits_70(servers, tiny_llama, tmp_path, version, death):
    fault, cause = DEATHS[death]
    arm = tmp_path / "arm"
    server = servers(version, tiny_llama, env=fault_env(fault, arm))
    server.warm_up()
    arm.touch()
    # Long prompts, so that a prefill fault strikes while both are in flight.
    prompt = "tell me more " * 40
    streaming = BackgroundRequest(
        lambda: server.chat(prompt, max_tokens=200, stream=True, timeout=CLIENT_TIMEOUT),
        name="stream")
    plain = BackgroundRequest(
        lambda: server.chat(prompt + "!", max_tokens=200, timeout=CLIENT_TIMEOUT), name="plain")
    # A request with a seed cannot join the batch: it waits for the batch to drain.
    queued = BackgroundRequest(
        lambda: server.chat("queued", max_tokens=5, seed=7, timeout=CLIENT_TIMEOUT),
        name="queued")

    assert server.wait_exit(CLIENT_TIMEOUT) == 70, server.log()
    # Each was answered: completed before the death, or told of it. The fault
    # strikes while they are in flight, so at least one was told.
    told = [_stream_outcome(streaming), _plain_outcome(plain)]
    assert "error" in told, (told, streaming, plain)
    # The third is sent last: on a loaded machine the death can come before it
    # connects (refused: the process is gone, no client was cut off). Once in,
    # it is answered like the others.
    if not (isinstance(queued.error, requests.ConnectionError) and queued.join(0)
            and "refused" in str(queued.error).lower()):
        _plain_outcome(queued)

    log = server.log()
    died = [l for l in server.hotfix_lines() if "generation thread died" in l]
    assert len(died) == 1 and died[0].startswith("mlx-hotfix: generation thread died: " + cause)
    assert died[0].endswith("; exiting 70")
    assert log.count("Traceback (most recent call last)") == 1
    assert log.index("Traceback") < log.index(died[0])


@pytest.mark.server
@pytest.mark.parametrize("version", VERSIONS)
def test_stock_server_without_the_shim_stays_a_zombie(servers, tiny_llama, tmp_path, version):
    """The control: the same death on stock never exits."""
    arm = tmp_path / "arm"
    server = servers(version, tiny_llama, shim=False,
                     env=fault_env("raise:resource:decode:2", arm, shim=False))
    server.warm_up()
    arm.touch()
    request = BackgroundRequest(lambda: server.chat("x", max_tokens=50, timeout=10))
    assert request.join(30)
    assert server.wait_exit(3) is None and server.alive()
    # 0.31.3 still calls itself healthy; 0.32.2 says 503 but never exits.
    assert server.health() == (200 if version == "0.31.3" else 503)
    assert "mlx-hotfix" not in server.log()


@pytest.mark.server
@pytest.mark.parametrize("version", VERSIONS)
def test_death_during_model_load_exits_70(servers, tmp_path, version):
    server = servers(version, tmp_path / "no-such-model")
    assert server.wait_exit(120) == 70, server.log()
    died = [l for l in server.hotfix_lines() if "generation thread died" in l]
    assert len(died) == 1 and "during start-up (model load)" in died[0], server.log()
    assert died[0].endswith("; exiting 70")


@pytest.mark.server
def test_stock_death_during_model_load_is_a_zombie(servers, tmp_path):
    import time

    server = servers("0.31.3", tmp_path / "no-such-model", shim=False)
    deadline = time.monotonic() + 120
    while "Traceback" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "Traceback" in server.log()
    assert server.wait_exit(3) is None and server.alive()


@pytest.mark.server
@pytest.mark.parametrize("launch", ["mlx_lm.server", "python -m mlx_lm.server", "script"])
def test_every_launch_form_is_covered(servers, tiny_llama, tmp_path, launch):
    arm = tmp_path / "arm"
    server = servers("0.31.3", tiny_llama, launch=launch,
                     env=fault_env("raise:broadcast:decode:2", arm))
    server.warm_up()
    assert any(l.startswith("mlx-hotfix: mlx-lm 0.31.3") and "exit applied" in l
               for l in server.hotfix_lines()), server.log()
    arm.touch()
    request = BackgroundRequest(lambda: server.chat("x", max_tokens=50, timeout=CLIENT_TIMEOUT))
    assert server.wait_exit(CLIENT_TIMEOUT) == 70, server.log()
    _assert_503_json(request)


POST_DEATH_SCRIPT = textwrap.dedent("""
    # Holds the process in its post-death state by catching os._exit, so the
    # test can look at /health and at a new request during the grace.
    import json, os, posix, socket, sys, threading, time
    import requests

    exit_codes, hold = [], threading.Event()
    def held_exit(code):
        exit_codes.append(code)
        hold.wait()
    os._exit = held_exit

    model, port, arm = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    import mlx_lm.server as server
    sys.argv = ["mlx_lm.server", "--model", model, "--port", str(port)]
    threading.Thread(target=server.main, daemon=True).start()
    url = "http://127.0.0.1:%d" % port
    body = {"model": "default_model", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 20}
    for _ in range(600):
        try:
            first = requests.post(url + "/v1/chat/completions", json=body, timeout=60)
            break
        except requests.ConnectionError:
            time.sleep(0.1)
    result = {"before": first.status_code,
              "health_before": requests.get(url + "/health").status_code}
    open(arm, "w").close()
    died = requests.post(url + "/v1/chat/completions", json=body, timeout=60)
    result["dying_request"] = died.status_code
    for _ in range(300):
        if exit_codes:
            break
        time.sleep(0.05)
    result["exit_code"] = exit_codes[0] if exit_codes else None
    result["health_after"] = requests.get(url + "/health", timeout=10).status_code
    late = requests.post(url + "/v1/chat/completions", json=body, timeout=10)
    result["late_request"] = [late.status_code, late.json()]
    print(json.dumps(result), flush=True)
    posix._exit(0)
""")


@pytest.mark.server
@pytest.mark.parametrize("version", VERSIONS)
def test_health_and_new_requests_say_503_once_the_thread_is_dead(envs, tiny_llama, tmp_path,
                                                                 version):
    from harness.server import free_port

    arm = tmp_path / "arm"
    result = run_python(version, POST_DEATH_SCRIPT,
                        env=fault_env("raise:slice:decode:1", arm),
                        args=[str(tiny_llama), str(free_port()), str(arm)], timeout=300)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["before"] == 200 and outcome["health_before"] == 200
    assert outcome["dying_request"] == 503
    assert outcome["exit_code"] == 70
    assert outcome["health_after"] == 503
    status, body = outcome["late_request"]
    assert status == 503
    assert body["error"]["message"] == "generation thread died (ValueError); the server is restarting"

    assert body["error"]["cause"] == "slice"  # the class (signatures.py), never the text

NEGATIVE_CONTROL_SCRIPT = textwrap.dedent("""
    import threading, sys
    import mlx_lm.server as server

    def _generate():  # a user's own function with the same name
        raise ValueError("user thread died")

    t = threading.Thread(target=_generate)
    t.start(); t.join()

    def other():
        raise RuntimeError("some other thread died")
    t = threading.Thread(target=other, name="worker")
    t.start(); t.join()

    class NotTheServer:
        _generation_thread = None
        model_provider = None
    # The server's own method, but not on its generation thread.
    t = threading.Thread(target=server.ResponseGenerator._generate, args=(NotTheServer(),))
    t.start(); t.join()
    print("still alive", flush=True)
""")


@pytest.mark.parametrize("version", VERSIONS)
def test_other_threads_dying_do_not_exit(envs, version):
    result = run_python(version, NEGATIVE_CONTROL_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "still alive"
    assert "ValueError: user thread died" in result.stderr
    assert "RuntimeError: some other thread died" in result.stderr
    assert result.stderr.count("Traceback (most recent call last)") == 3
    assert "generation thread died" not in result.stderr


def test_exit_switch_off_leaves_stock_behaviour(envs):
    # The mark every wrapper carries (mlx_hotfix._wrap), not __module__:
    # a wrapper made with functools.wraps would copy __module__ too.
    code = ("import mlx_lm.server as s; from mlx_hotfix._wrap import _MARK, wrapped_by; "
            "g = s.ResponseGenerator._generate; "
            "print(wrapped_by(g, 'exit'), getattr(g, _MARK, None), hasattr(g, '__wrapped__'))")
    result = run_python("0.31.3", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "True"  # the control: the check can see a wrapper
    result = run_python("0.31.3", code, env={"MLX_HOTFIX_DISABLE": "exit"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "False"  # the heartbeat part may wrap it, not exit
    result = run_python("0.31.3", code, env={"MLX_HOTFIX_DISABLE": "exit,heartbeat"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False None False"  # the stock function itself


SECRET = "zebra-quartz-lantern"


@pytest.mark.server
@pytest.mark.parametrize("version", VERSIONS)
def test_a_death_tells_clients_its_type_and_the_report_a_redacted_message(
        servers, tiny_llama, tmp_path, version):
    # An exception that quotes one client's request (here: a fault's text).
    arm = tmp_path / "arm"
    env = fault_env("raise:quoted:decode:2", arm)
    env["MLX_TEST_FAULT_MESSAGE"] = "cannot decode 'client A wrote: %s %s' at [%s]" % (
        SECRET, SECRET, ", ".join(map(str, range(100, 120))))
    env["MLX_HOTFIX_EXIT_GRACE"] = "60"
    server = servers(version, tiny_llama, env=env)
    server.warm_up()
    # Half a request: the exit waits for it (within the grace), so /health can be asked.
    held = socket.create_connection(("127.0.0.1", server.port))
    held.sendall(b"GET /health HTTP/1.1\r\n")
    server.warm_up()  # its connection came after the held one: that one is in its handler
    arm.touch()
    plain = BackgroundRequest(lambda: server.chat("A", max_tokens=50, timeout=CLIENT_TIMEOUT))
    stream = BackgroundRequest(
        lambda: server.chat("B", max_tokens=50, stream=True, timeout=CLIENT_TIMEOUT))
    assert plain.join(CLIENT_TIMEOUT) and stream.join(CLIENT_TIMEOUT)
    health = requests.get(f"{server.url}/health", timeout=10)
    held.sendall(b"\r\n")
    held.recv(4096)
    held.close()
    assert server.wait_exit(CLIENT_TIMEOUT) == 70, server.log()

    sentence = "generation thread died (ValueError); the server is restarting"
    _assert_503_json(plain)
    assert plain.json()["error"]["message"] == sentence
    _assert_stream_ends_with_error(stream)
    told = sse_events(stream.body)[-1] if stream.status == 200 else stream.json()
    assert told["error"]["message"] == sentence
    assert health.status_code == 503 and health.json()["error"] == sentence
    for answer in (plain.body, stream.body, health.content):
        assert SECRET.encode() not in answer

    [report_file] = server.report_dir.glob("*-died-*.json")
    text = report_file.read_text()
    assert SECRET not in text and "100, 101" not in text
    exception = json.loads(text)["exception"]
    assert exception["type"] == "builtins.ValueError" and exception["message_redacted"] is True
    assert exception["message"] == (
        "cannot decode '<redacted 57 chars>' at [<redacted 20 numbers>]")
    assert "_generate" in exception["traceback"]  # the frames stay
    assert exception["traceback"].endswith("builtins.ValueError: " + exception["message"] + "\n")


@pytest.mark.server
@pytest.mark.parametrize("shim_fault,extra,said", [
    ("reaper-start", {}, "cannot start the exit thread (RuntimeError: can't start new thread); "
                         "exiting from the dying thread"),
    ("plan", {"MLX_HOTFIX_RECOVER": "thread"},
     "the exit path failed (RuntimeError: injected: the recovery plan failed); exiting 70"),
])
@pytest.mark.parametrize("version", VERSIONS)
def test_the_death_path_ends_in_the_exit_whatever_fails_on_it(servers, tiny_llama, tmp_path,
                                                             version, shim_fault, extra, said):
    # Without the guard the reaper never runs (or dies), and the process stays a
    # 503 zombie: the failure of #1505 itself.
    arm = tmp_path / "arm"
    env = dict(fault_env("raise:slice:decode:1", arm), MLX_TEST_SHIM_FAULT=shim_fault, **extra)
    server = servers(version, tiny_llama, env=env)
    server.warm_up()
    arm.touch()
    request = BackgroundRequest(lambda: server.chat("x", max_tokens=20, timeout=CLIENT_TIMEOUT))
    assert server.wait_exit(CLIENT_TIMEOUT) == 70, server.log()
    _assert_503_json(request)
    assert "mlx-hotfix: " + said in server.hotfix_lines(), server.hotfix_lines()
    assert "ValueError: Slice indices must be 32-bit integers." in server.log()
