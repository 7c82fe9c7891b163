"""The watchdog against real processes: the real `mlx-watchdog` CLI as a
subprocess, supervising the real stock mlx_lm.server (tiny generated model,
CPU) or watching small fake servers that misbehave on purpose.

Short settings for speed (probe every 1 s, 2 s timeout, 3 failures, 3 s
heartbeat timeout). No timing assertions: outcomes, with generous bounded
waits. Every process started here is killed at the end of its test, by
process group (harness/watchdog_run.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import List

import psutil
import pytest
import requests

from tests.conftest import fault_env
from harness import FAKE_SERVER
from harness.fakeserver import DRIBBLE_BODY, OK, FakeServer, json_answer
from harness.repro import EXTEND_CRASH_ARGS, PENALTY, long_prompt
from harness.server import BackgroundRequest, base_env, free_port, python_for
from harness.procs import chat
from harness.watchdog_run import WatchdogProcess, is_gone, wait_serving

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parents[1]
FAST = ["--probe-interval", "1", "--probe-timeout", "2", "--failures", "3",
        "--boot-grace", "30", "--heartbeat-timeout", "3", "--stop-grace", "3"]
LOAD_S = 180  # bound for a server to load and answer (a slow, shared machine)
SLEEP_FOREVER = [sys.executable, "-c", "import time; time.sleep(3600)"]
# A restart command that records the arguments it was given, one JSON list a line.
RECORDER = "import json, sys; open(sys.argv[1], 'a').write(json.dumps(sys.argv[2:]) + '\\n')"


@pytest.fixture
def watchdogs(tmp_path):
    started: List[WatchdogProcess] = []

    def start(args, *, name="watchdog", env=None, **kwargs) -> WatchdogProcess:
        environment = base_env(shim=False)
        environment.pop("MLX_WATCHDOG_API_KEY", None)  # only where a test gives one
        environment.update(env or {})
        proc = WatchdogProcess(tmp_path, args, name=f"{name}-{len(started)}",
                               env=environment, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.cleanup()


def server_command(version: str, model: Path, port: int, *args: str) -> list:
    return [str(python_for(version)), "-m", "mlx_lm", "server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), *args]


def state_changes(proc: WatchdogProcess) -> List[str]:
    return [e["state"] for e in proc.events() if e["event"] == "state"]


def restart_events(proc: WatchdogProcess) -> List[dict]:
    return [e for e in proc.events() if e["event"] == "restart"]


def assert_never_crashed(proc: WatchdogProcess, *, child_output: bool = False) -> None:
    """The watchdog is running and logged no failed tick, and no traceback
    (unless a child's output, which may hold its own, shares the log)."""
    assert proc.alive(), proc.tail()
    events = proc.events()
    assert not [e for e in events if e["event"] == "error" or "exception" in e], proc.tail()
    if not child_output:
        assert "Traceback" not in proc.text(), proc.tail()


def strike(proc: WatchdogProcess, arm: Path, trigger) -> None:
    """Arm the fault, trigger it, and disarm it as soon as it struck, so that the
    restarted child does not meet it again."""
    arm.touch()
    trigger()
    proc.wait_for(lambda: "mlx-test-fault: " in proc.text(), 60, "the fault to strike")
    arm.unlink()


def hung_request(url: str) -> BackgroundRequest:
    return BackgroundRequest(lambda: chat(url, "tell me a story", max_tokens=50, timeout=60),
                             name="hung")


# -- 1. a generation loop that hangs or spins while alive; a stopped process ---------------


@pytest.mark.parametrize("fault", ["hang:decode", "spin:decode"])
def test_a_loop_that_hangs_or_spins_is_restarted_for_its_stale_heartbeat(
        watchdogs, tiny_llama, tmp_path, fault):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    arm = tmp_path / "arm"
    sup = watchdogs(["supervise", *FAST, "--", *server_command("0.32.2", tiny_llama, port)],
                    env=fault_env(fault, arm, shim=False))  # supervise adds the shim itself
    wait_serving(url, LOAD_S, log=sup)
    first = sup.current_child()
    sup.wait_event(lambda e: e.get("state") == "healthy", 60, "a healthy probe")

    strike(sup, arm, lambda: hung_request(url))
    restart = sup.wait_event(lambda e: e["event"] == "restart", 120, "a restart")
    assert restart["cause"] == "heartbeat-stale", restart
    assert "heartbeat stale" in restart["message"]
    wait_serving(url, LOAD_S, log=sup)  # serving again: a completion answered 200
    sup.wait_for(lambda: is_gone(first), 30, "the wedged child to be gone")
    assert sup.current_child() != first
    record = sup.record()
    assert record["restarts"] == 1 and record["last_restart"]["cause"] == "heartbeat-stale"
    assert record["last_restart"]["ok"] is True
    assert_never_crashed(sup, child_output=True)
    assert sup.terminate() == 0


def test_a_stopped_server_is_restarted_and_sigterm_reaches_it(watchdogs, tiny_llama):
    # SIGSTOP the whole server: no answers, no beats, no CPU. A stopped process
    # acts on SIGTERM only once continued: the supervisor sends SIGCONT after
    # it, so the child dies of the SIGTERM at once, not of the SIGKILL at the
    # end of a long --stop-grace.
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = [*FAST[:-2], "--stop-grace", "120"]
    sup = watchdogs(["supervise", *flags, "--", *server_command("0.32.2", tiny_llama, port)])
    wait_serving(url, LOAD_S, log=sup)
    sup.wait_event(lambda e: e.get("state") == "healthy", 60, "a healthy probe")
    first = sup.current_child()
    os.killpg(first, signal.SIGSTOP)
    sup.wait_for(lambda: psutil.Process(first).status() == psutil.STATUS_STOPPED, 30,
                 "the server to stop")

    restart = sup.wait_event(lambda e: e["event"] == "restart", 120, "a restart")
    assert restart["cause"] == "heartbeat-stale", restart
    stopped = sup.wait_event(lambda e: e["event"] == "stopped", 60, "the stopped child")
    assert stopped["message"] == f"pid {first} was killed by SIGTERM", stopped
    wait_serving(url, LOAD_S, log=sup)
    assert sup.record()["last_restart"]["cause"] == "heartbeat-stale"
    assert_never_crashed(sup, child_output=True)
    assert sup.terminate() == 0


def test_sigterm_to_the_supervisor_stops_a_stopped_child(watchdogs):
    sup = watchdogs(["supervise", "--no-shim", "--stop-grace", "120", "--url",
                     f"http://127.0.0.1:{free_port()}", "--", *SLEEP_FOREVER])
    child = sup.wait_for(sup.current_child, 30, "the child")
    sup.wait_for(lambda: "time.sleep" in " ".join(psutil.Process(child).cmdline()), 30,
                 "the child to run python")
    sup.wait_for(lambda: sup.record().get("last_probe"), 30, "a first probe")
    os.killpg(child, signal.SIGSTOP)
    sup.wait_for(lambda: psutil.Process(child).status() == psutil.STATUS_STOPPED, 30,
                 "the child to stop")
    assert sup.terminate(timeout=60) == 0  # well within the 120 s grace
    stopped = sup.wait_event(lambda e: e["event"] == "stopped", 10, "the stopped child")
    assert stopped["message"] == f"pid {child} was killed by SIGTERM"
    assert is_gone(child)


def test_a_signal_restart_reaches_a_stopped_process():
    # watch's `signal` action, on a real stopped process.
    from mlx_watchdog.act import SignalRestart

    proc = subprocess.Popen(SLEEP_FOREVER, start_new_session=True)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        result = SignalRestart(pid=proc.pid, grace_s=120).restart("wedged")
        assert result.ok and result.detail == f"sent SIGTERM to pid {proc.pid}; it exited"
        assert is_gone(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- 2. the stock 0.31.3 zombie after the real two-request crash, no shim -----------------


def test_the_stock_031_zombie_is_judged_wedged_and_restarted(watchdogs, tiny_llama):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sup = watchdogs(["supervise", "--no-shim", *FAST, "--",
                     *server_command("0.31.3", tiny_llama, port, *EXTEND_CRASH_ARGS)])
    # The crash needs a warm-up with a penalty (harness/repro.py).
    wait_serving(url, LOAD_S, log=sup, repetition_penalty=PENALTY)
    sup.wait_event(lambda e: e.get("state") == "healthy", 60, "a healthy probe")  # grace over
    first = sup.current_child()
    pairs = []
    for attempt in range(5):  # it depends on timing: send the pair again if it missed
        prompt = long_prompt(attempt)
        a = BackgroundRequest(lambda prompt=prompt: chat(url, prompt, max_tokens=20, timeout=30), name="A")
        time.sleep(0.05)
        b = BackgroundRequest(lambda prompt=prompt: chat(url, prompt + " and then some more", max_tokens=20,
                                           timeout=30, repetition_penalty=PENALTY), name="B")
        pairs.append((a, b))
        sup.wait_for(
            lambda a=a, b=b: "TypeError: 'NoneType' object is not iterable" in sup.text()
            or (a.finished_at and b.finished_at), 60, "the pair to crash or complete")
        if "TypeError" in sup.text():
            break
    assert "TypeError: 'NoneType' object is not iterable" in sup.text(), pairs

    restart = sup.wait_event(lambda e: e["event"] == "restart", 120, "a restart")
    assert restart["cause"] == "no-progress", restart  # probes time out, CPU idle
    assert "CPU idle" in restart["message"]
    wait_serving(url, LOAD_S, log=sup)
    assert is_gone(first) and sup.current_child() != first
    assert sup.record()["last_restart"]["cause"] == "no-progress"
    assert_never_crashed(sup, child_output=True)
    assert sup.terminate() == 0


# -- 3. stock 0.32.2 whose generation thread died, no shim ---------------------------------


def test_the_stock_032_dead_thread_is_restarted(watchdogs, tiny_llama, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    arm = tmp_path / "arm"
    sup = watchdogs(["supervise", "--no-shim", *FAST, "--",
                     *server_command("0.32.2", tiny_llama, port)],
                    env=fault_env("raise:resource:decode:2", arm, shim=False))
    wait_serving(url, LOAD_S, log=sup)
    sup.wait_event(lambda e: e.get("state") == "healthy", 60, "a healthy probe")  # grace over
    first = sup.current_child()
    strike(sup, arm, lambda: hung_request(url))

    restart = sup.wait_event(lambda e: e["event"] == "restart", 120, "a restart")
    assert restart["cause"] == "dead-thread", restart
    # What the probes saw of the zombie: 404 "generation thread died".
    failing = [e for e in sup.events() if e.get("state") == "failing"]
    assert failing and "HTTP 404: generation thread died" in failing[0]["message"], failing
    wait_serving(url, LOAD_S, log=sup)
    assert is_gone(first)
    assert sup.record()["last_restart"]["cause"] == "dead-thread"
    assert_never_crashed(sup, child_output=True)
    assert sup.terminate() == 0


# -- 4. a saturated, healthy server is never restarted -------------------------------------


SATURABLE = ("--decode-concurrency", "1", "--prompt-concurrency", "1")


def decode_rate(url: str) -> float:
    """Tokens per second of one request on this (idle) server, now."""
    started = time.monotonic()
    response = chat(url, "measure", max_tokens=500, timeout=120)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 500
    return 500 / (time.monotonic() - started)


@pytest.mark.parametrize("shim", [True, False], ids=["shim-heartbeat", "no-shim-cpu"])
def test_a_saturated_server_is_never_restarted(watchdogs, tiny_llama, shim):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--probe-interval", "1", "--probe-timeout", "2", "--failures", "3",
             "--boot-grace", "30", "--heartbeat-timeout", "3"]
    # --decode-concurrency 1 alone does not hold a probe back on 0.32.2: a
    # one-token completion gets its token from the prefill, which runs beside
    # the decode. With --prompt-concurrency 1 too, it waits for the queue.
    sup = watchdogs(["supervise", *([] if shim else ["--no-shim"]), *flags, "--",
                     *server_command("0.32.2", tiny_llama, port, *SATURABLE)])
    wait_serving(url, LOAD_S, log=sup)
    sup.wait_event(lambda e: e.get("state") == "healthy", 60, "a healthy probe")
    child = sup.current_child()
    # About 25 s of queued work, one request at a time: every probe waits
    # behind it far longer than its 2 s timeout.
    max_tokens = int(min(max(decode_rate(url) * 25 / 4, 1000), 8000))
    long = [BackgroundRequest(lambda i=i: chat(url, f"long story {i}", max_tokens=max_tokens,
                                           timeout=600), name=f"long-{i}") for i in range(4)]
    for request in long:
        assert request.join(600), f"{request} never returned\n{sup.tail()}"
    for request in long:
        assert request.status == 200, request
        assert request.json()["usage"]["completion_tokens"] == max_tokens, request
        assert request.json()["choices"][0]["finish_reason"] == "length"
    sup.wait_for(lambda: sup.record().get("state") == "healthy", 60, "healthy after the queue")

    states = state_changes(sup)
    assert "busy" in states, states  # probes did fail, and were judged busy
    assert not {"failing", "wedged", "down"} & set(states), states
    assert restart_events(sup) == [] and sup.record()["restarts"] == 0
    assert sup.child_pids() == [child] and not is_gone(child)
    assert_never_crashed(sup, child_output=True)
    assert sup.terminate() == 0


# -- 5. adversaries -------------------------------------------------------------------------


def toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def recorder_argv(record: Path, *extra: str) -> str:
    argv = [sys.executable, "-c", RECORDER, str(record), *extra]
    return "[" + ", ".join(toml_string(a) for a in argv) + "]"


def command_restart(argv_toml: str) -> str:
    return f'{{ type = "command", argv = {argv_toml} }}'


def watch_config(path: Path, instances: dict, **top) -> Path:
    lines = [f"{key} = {value}" for key, value in top.items()]
    for name, keys in instances.items():
        lines.append(f"\n[instances.{name}]")
        keys = {"interval": "0.3", "timeout": "1", "failures": "2", "boot_grace": "0", **keys}
        lines += [f"{key} = {value}" for key, value in keys.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def recorded(record: Path) -> List[list]:
    try:
        return [json.loads(line) for line in record.read_text().splitlines()]
    except FileNotFoundError:
        return []


def test_garbage_errors_and_slow_loris_are_restarted_with_a_clear_reason(watchdogs, tmp_path):
    fakes = {
        "garbage": FakeServer(completion=(200, b"<html>not json at all")),
        "error500": FakeServer(completion=json_answer(500, {"error": "boom"})),
        "slowloris": FakeServer(completion=DRIBBLE_BODY),
    }
    expected = {  # cause, and what the restart's reason says
        "garbage": ("bad-answer", "200 with a malformed body"),
        "error500": ("bad-answer", "HTTP 500: boom"),
        "slowloris": ("busy-too-long", "timed out after 1s"),
    }
    for fake in fakes.values():
        fake.__enter__()
    try:
        config = watch_config(tmp_path / "watch.toml", {
            name: {"url": toml_string(fake.url),
                   "restart": command_restart(recorder_argv(tmp_path / name)),
                   **({"max_busy": "3"} if name == "slowloris" else {})}
            for name, fake in fakes.items()})
        watch = watchdogs(["watch", "--config", str(config)])
        for name in fakes:
            watch.wait_for(lambda name=name: recorded(tmp_path / name), 60, f"{name} restarted")
        for name, (cause, reason) in expected.items():
            restart = next(e for e in restart_events(watch) if e["instance"] == name)
            assert restart["cause"] == cause and reason in restart["message"], restart
            last = watch.wait_for(lambda name=name: watch.record(name).get("last_restart"), 30,
                                  f"{name}'s restart in the state file")
            assert last["cause"] == cause
        slow = next(e for e in restart_events(watch) if e["instance"] == "slowloris")
        assert "no successful probe for" in slow["message"] and "max_busy 3s" in slow["message"]
        time.sleep(2)  # and it keeps watching
        assert_never_crashed(watch)
        assert watch.terminate() == 0
    finally:
        for fake in fakes.values():
            fake.__exit__(None, None, None)


@pytest.mark.parametrize("argv, detail", [
    ('["false"]', "false exited with status 1"),
    ('["/nonexistent/bin/restart-mlx", "--now"]',
     "/nonexistent/bin/restart-mlx: command not found"),
])
def test_a_failing_restart_action_is_logged_and_the_watchdog_goes_on(
        watchdogs, tmp_path, argv, detail):
    with FakeServer(completion=json_answer(500, {"error": "boom"})) as fake:
        config = watch_config(tmp_path / "watch.toml", {
            "gemma": {"url": toml_string(fake.url),
                      "restart": command_restart(argv)}})
        watch = watchdogs(["watch", "--config", str(config)])
        failed = watch.wait_event(lambda e: e["event"] == "restart-failed", 60,
                                  "a failed restart")
        assert failed["message"] == detail and failed["level"] == "error"
        # Still ticking: the backoff's second attempt fails the same way.
        count = len(watch.events())
        watch.wait_event(lambda e: e["event"] == "restart-failed", 60, "a second attempt",
                         after=count)
        record = watch.record("gemma")
        assert record["last_restart"]["ok"] is False and record["last_restart"]["detail"] == detail
        assert_never_crashed(watch)
        assert watch.terminate() == 0


def test_connection_refused_while_the_new_child_loads_is_starting_not_a_crash(
        watchdogs, tmp_path):
    # First start: one good answer, then it hangs (idle CPU). Every later start
    # waits 4 s before it listens: connection refused, as while a model loads.
    port = free_port()
    slow_start = (
        "import runpy, sys, time\n"
        "starts = sys.argv[sys.argv.index('--starts') + 1]\n"
        "try:\n"
        "    started_before = bool(open(starts).read().strip())\n"
        "except FileNotFoundError:\n"
        "    started_before = False\n"
        "if started_before:\n"
        "    time.sleep(4)\n"
        f"sys.argv = [{str(FAKE_SERVER)!r}] + sys.argv[1:]\n"
        f"runpy.run_path({str(FAKE_SERVER)!r}, run_name='__main__')\n"
    )
    sup = watchdogs(["supervise", "--no-shim", "--probe-interval", "0.5", "--probe-timeout", "1",
                     "--failures", "2", "--boot-grace", "30", "--stop-grace", "3", "--",
                     sys.executable, "-c", slow_start, "--port", str(port),
                     "--starts", str(tmp_path / "starts"), "--first-start", "hang"])
    restart = sup.wait_event(lambda e: e["event"] == "restart", 60, "a restart")
    assert restart["cause"] == "no-progress"
    count = sup.events().index(restart)
    refused = sup.wait_event(lambda e: e["event"] == "state" and e["state"] == "starting"
                             and "Connection refused" in e["message"], 30,
                             "a refused probe while the new child starts", after=count)
    assert refused["level"] == "info"
    sup.wait_event(lambda e: e.get("state") == "healthy", 60, "healthy again", after=count)
    assert sup.record()["restarts"] == 1
    assert_never_crashed(sup)
    assert sup.terminate() == 0


def test_a_crash_loop_is_shown_and_restarts_never_stop(watchdogs):
    # Default probe interval (5 s): the exits are seen at once all the same (SIGCHLD).
    sup = watchdogs(["supervise", "--no-shim", "--max-restarts", "3", "--restart-window", "120",
                     "--backoff-max", "2", "--url", f"http://127.0.0.1:{free_port()}", "--",
                     sys.executable, "-c", "import sys; sys.exit(70)"])
    looping = sup.wait_event(lambda e: e.get("state") == "crash-looping", 60, "crash-looping")
    assert "crash-looping: " in looping["message"], looping
    assert "server exited with code 70" in looping["message"]  # no shim: no claim
    # Crash-looping is shown, never obeyed: restarts go on at the capped backoff.
    sup.wait_for(lambda: len(sup.child_pids()) >= 12, 120, "restarts to go on")
    assert sup.alive()
    record = sup.record()
    assert record["state"] == "crash-looping" and record["restarts"] >= 11
    assert_never_crashed(sup)
    status = subprocess.run([sys.executable, "-m", "mlx_watchdog", "status", "--state-file",
                             str(sup.state_path)], capture_output=True, text=True, timeout=60)
    assert "crash-looping" in status.stdout, status
    assert sup.terminate() == 0


# -- 6. the API key: sent, never shown -----------------------------------------------------


def test_the_api_key_is_sent_and_never_shown(watchdogs, tmp_path):
    keys = {way: f"sk-{way}-{uuid.uuid4().hex}" for way in ("flag", "env", "config")}
    seen = {}

    def echo_after_two(key):
        count = [0]

        def completion(body):
            count[0] += 1
            # A careless proxy that repeats the credential in its error.
            return OK if count[0] <= 2 else json_answer(401, {"error": f"invalid key {key}"})

        return completion

    fakes = {way: FakeServer(completion=echo_after_two(key)) for way, key in keys.items()}
    for fake in fakes.values():
        fake.__enter__()
    try:
        metrics_ports = {way: free_port() for way in keys}
        common = ["--probe-interval", "0.3", "--probe-timeout", "1", "--failures", "2",
                  "--boot-grace", "0", "--stop-grace", "3",
                  "--no-listener-check"]  # the fake server is not the child's
        runs = {
            "flag": watchdogs(["supervise", "--no-shim", *common, "--api-key", keys["flag"],
                               "--url", fakes["flag"].url,
                               "--metrics-port", str(metrics_ports["flag"]), "--",
                               *SLEEP_FOREVER], name="flag"),
            "env": watchdogs(["supervise", "--no-shim", *common, "--url", fakes["env"].url,
                              "--metrics-port", str(metrics_ports["env"]), "--",
                              *SLEEP_FOREVER], name="env",
                             env={"MLX_WATCHDOG_API_KEY": keys["env"]}),
        }
        config = watch_config(tmp_path / "watch.toml", {
            "gemma": {"url": toml_string(fakes["config"].url),
                      "api_key": toml_string(keys["config"]),
                      "restart": command_restart(recorder_argv(tmp_path / "r"))}},
            metrics_port=str(metrics_ports["config"]))
        runs["config"] = watchdogs(["watch", "--config", str(config)], name="config")

        for way, run in runs.items():
            run.wait_event(lambda e: e["event"] == "restart", 60, f"a restart ({way})")
            text = urlopen_text(f"http://127.0.0.1:{metrics_ports[way]}/metrics")
            assert "mlx_watchdog_restarts_total" in text
            seen[way] = text
        for run in runs.values():
            assert run.terminate() == 0
        for way, key in keys.items():
            fake, run = fakes[way], runs[way]
            headers = [h for path, h, _ in fake.requests if path == "/v1/chat/completions"]
            assert headers and all(h.get("Authorization") == f"Bearer {key}" for h in headers)
            status = subprocess.run(
                [sys.executable, "-m", "mlx_watchdog", "status", "--json", "--state-file",
                 str(run.state_path)], capture_output=True, text=True, timeout=60)
            # Exit 1: the watchdog stopped, so nothing is watched (stopped, not healthy).
            assert status.returncode == 1 and "invalid key ***" in status.stdout, status
            assert "invalid key ***" in run.text()  # the echo was scrubbed, not dropped
            for where, text in [("log", run.text()), ("state file", run.state_path.read_text()),
                                ("status --json", status.stdout + status.stderr),
                                ("metrics", seen[way])]:
                assert key not in text, f"the {way} key shows in the {where}"
    finally:
        for fake in fakes.values():
            fake.__exit__(None, None, None)


def urlopen_text(url: str) -> str:
    response = requests.get(url, timeout=10)
    assert response.status_code == 200
    return response.text


# -- 7. restart actions are argv lists, never a shell string --------------------------------


def test_a_shell_string_as_argv_is_a_config_error_naming_the_key(tmp_path):
    config = watch_config(tmp_path / "watch.toml", {
        "gemma": {"url": '"http://127.0.0.1:8080"',
                  "restart": '{ type = "command", argv = "systemctl restart x" }'}})
    for extra in (["--check"], []):
        result = subprocess.run(
            [sys.executable, "-m", "mlx_watchdog", "watch", "--config", str(config), *extra,
             "--state-file", str(tmp_path / "state.json")],
            capture_output=True, text=True, timeout=60)
        assert result.returncode == 1, result
        assert "instances.gemma.restart.argv: expected a list of strings" in result.stderr
        assert "no shell is involved" in result.stderr and '"systemctl restart x"' in result.stderr
        assert not (tmp_path / "state.json").exists()  # nothing started


def test_shell_metacharacters_in_a_command_are_passed_literally(watchdogs, tmp_path):
    pwned = Path("/tmp") / f"pwned-{uuid.uuid4().hex}"
    nasty = [f"; touch {pwned}", f"$(touch {pwned}-2)", f"`touch {pwned}-3`", "| cat", "*"]
    record = tmp_path / "record"
    with FakeServer(completion=json_answer(500, {"error": "boom"})) as fake:
        config = watch_config(tmp_path / "watch.toml", {
            "gemma": {"url": toml_string(fake.url),
                      "restart": command_restart(recorder_argv(record, *nasty))}})
        watch = watchdogs(["watch", "--config", str(config)])
        watch.wait_for(lambda: recorded(record), 60, "the restart command")
        assert watch.terminate() == 0
    assert recorded(record)[0] == nasty
    for suffix in ("", "-2", "-3"):
        assert not Path(f"{pwned}{suffix}").exists()


# -- a restart that fails says so, and reports nothing about a process that is gone --------


def test_a_failed_signal_restart_is_down_not_starting_and_writes_no_report(watchdogs, tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)  # a pid that names nobody now
    heartbeat = tmp_path / "left-behind.heartbeat"  # from the server that was there
    heartbeat.write_text(json.dumps({"pid": gone.pid, "beats": 9, "time": time.time() - 600,
                                     "phase": "serving"}))
    reports = tmp_path / "reports"
    with FakeServer(completion=json_answer(500, {"error": "boom"})) as fake:
        config = watch_config(tmp_path / "watch.toml", {
            "gemma": {"url": toml_string(fake.url + "/v1"),  # as OpenAI clients are given it
                      "heartbeat_file": toml_string(str(heartbeat)),
                      "report_dir": toml_string(str(reports)),
                      "restart": f'{{ type = "signal", pid = {gone.pid} }}'}})
        watch = watchdogs(["watch", "--config", str(config)])
        failed = watch.wait_event(lambda e: e["event"] == "restart-failed", 60, "the restart")
        count = len(watch.events())
        watch.wait_event(lambda e: e["event"] == "restart-failed", 60, "a second attempt",
                         after=count)
        states = [e for e in watch.events() if e["event"] == "state"]
        after = [e["state"] for e in states if e["time"] >= failed["time"]]
        assert "starting" not in after, states  # nothing was started
        record = watch.record("gemma")
        assert record["state"] == "down" and record["last_restart"]["ok"] is False, record
        assert str(gone.pid) in failed["message"], failed
        assert record["url"] == fake.url  # /v1 normalised away
        # The probes reached the server's root: its 500, not a 404 for /v1/v1/...
        assert record["last_probe"]["http_status"] == 500, record
        assert not reports.exists() or not list(reports.glob("*.json"))
        assert watch.terminate() == 0
