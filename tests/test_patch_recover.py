"""recover (MLX_HOTFIX_RECOVER=thread): a death is answered as always, then a
fresh generation loop serves in the same process with the model it already
had. Real stock 0.31.3 and 0.32.2 servers, one-shot faults (harness/faults)
armed per death; model loads traced by the fault injector."""

from __future__ import annotations

import json
import os
import socket
import time

import psutil
import pytest

from tests.conftest import arm_fault, fault_env
from harness.repro import EXTEND_CRASH_ARGS, send_extend_crash_pair, warm_up_with_penalty
from harness.server import VERSIONS

pytestmark = pytest.mark.server

LOAD_LINE = "mlx-test-trace: model load"
PROMPT = "tell me about the sea"


def _recover_env(arm, **extra):
    env = fault_env("raise:typeerror:decode:2", arm)
    env.update(MLX_HOTFIX_RECOVER="thread", MLX_TEST_FAULT_ONESHOT="1",
               MLX_TEST_TRACE_LOADS="1")
    env.update(extra)
    return env


def _content(response) -> str:
    assert response.status_code == 200, (response.status_code, response.text)
    return response.json()["choices"][0]["message"]["content"]


def _die_once(server, arm, kind="") -> None:
    """Arm the fault; the next request dies (503) and the server comes back."""
    arm_fault(arm, kind)
    dying = server.chat(PROMPT + " again", max_tokens=16, timeout=60)
    assert dying.status_code == 503, (dying.status_code, dying.text, server.log()[-3000:])
    assert "generation thread died" in dying.json()["error"]["message"]
    deadline = time.monotonic() + 60
    while server.health() != 200:
        assert server.alive(), server.log()[-3000:]
        assert time.monotonic() < deadline, "never healthy again:\n" + server.log()[-3000:]
        time.sleep(0.05)


@pytest.mark.parametrize("version", VERSIONS)
def test_next_request_after_a_death_is_served_in_place_without_a_load(
        servers, tiny_llama, tmp_path, version):
    # A fresh server's greedy answer: same model, same flags, no fault; its
    # first and only request.
    reference = servers(version, tiny_llama, env={"MLX_HOTFIX_RECOVER": "thread"})
    reference.wait_listening(120)
    fresh = _content(reference.chat(PROMPT, max_tokens=24, timeout=120))
    reference.stop()

    arm = tmp_path / "arm"
    server = servers(version, tiny_llama, env=_recover_env(arm))
    server.warm_up()
    lines = server.hotfix_lines()
    assert "recover applied (mode thread, at most 3 in 600 s)" in lines[0], lines
    pid = server.proc.pid

    _die_once(server, arm)
    after = server.chat(PROMPT, max_tokens=24)
    assert _content(after) == fresh
    assert server.alive() and server.proc.pid == pid
    assert psutil.Process(pid).is_running()
    log = server.log()
    assert log.count(LOAD_LINE) == 1, log  # the start-up load only
    assert any(l.endswith("recovering in place (1 of at most 3 in 600 s)")
               for l in server.hotfix_lines()), server.hotfix_lines()
    assert ("mlx-hotfix: recovered: a fresh generation loop serves (pid unchanged, model reused)"
            in server.hotfix_lines())


def _footprint(pid):
    process = psutil.Process(pid)
    return process.num_threads(), process.num_fds(), process.memory_info().rss


@pytest.mark.parametrize("version", VERSIONS)
def test_twenty_deaths_in_a_row_leave_no_growth_and_the_patches_in_force(
        servers, tiny_llama, tmp_path, version):
    arm = tmp_path / "arm"
    # Room for all twenty: a recovery takes a fraction of a second, so they
    # may come faster than any small limit per window allows.
    server = servers(version, tiny_llama, args=EXTEND_CRASH_ARGS, env=_recover_env(
        arm, MLX_HOTFIX_RECOVER_LIMIT="100", MLX_HOTFIX_RECOVER_WINDOW="1"))
    warm_up_with_penalty(server)
    fresh = _content(server.chat(PROMPT, max_tokens=24))
    pid = server.proc.pid
    for _ in range(2):  # the first recoveries settle allocator caches
        _die_once(server, arm)
        assert _content(server.chat(PROMPT, max_tokens=24)) == fresh
    threads0, fds0, rss0 = _footprint(pid)
    for _ in range(18):
        _die_once(server, arm)
        assert _content(server.chat(PROMPT, max_tokens=24)) == fresh
    threads, fds, rss = _footprint(pid)
    log = server.log()
    assert log.count("mlx-hotfix: recovered:") == 20 and log.count(LOAD_LINE) == 1
    assert server.proc.pid == pid and server.alive()
    assert threads <= threads0 + 1, (threads0, threads)
    assert fds <= fds0 + 2, (fds0, fds)
    assert rss <= rss0 + 40 * 2**20, (rss0, rss)

    # The extend patch (0.31.x; upstream-fixed in 0.32) still holds: the pair
    # that kills stock 0.31.3 completes, and nothing dies.
    a, b = send_extend_crash_pair(server, timeout=120)
    assert a.join(130) and b.join(130)
    assert (a.status, b.status) == (200, 200), (a, b)
    assert server.log().count("mlx-hotfix: generation thread died") == 20
    assert "advance applied" in server.hotfix_lines()[0]


@pytest.mark.parametrize("version", VERSIONS)
def test_past_the_limit_the_process_exits_70(servers, tiny_llama, tmp_path, version):
    arm = tmp_path / "arm"
    server = servers(version, tiny_llama, env=_recover_env(arm, MLX_HOTFIX_RECOVER_LIMIT="1"))
    server.warm_up()
    _die_once(server, arm)
    assert _content(server.chat(PROMPT, max_tokens=8))
    arm.touch()
    dying = server.chat(PROMPT + " again", max_tokens=16, timeout=60)
    assert dying.status_code == 503
    assert server.wait_exit(60) == 70, server.log()[-3000:]
    lines = server.hotfix_lines()
    assert "mlx-hotfix: recovery limit reached (1 in 600 s)" in lines
    assert lines[-1].endswith("; exiting 70"), lines


def test_a_recovery_does_not_wait_for_a_client_that_keeps_its_connection(
        servers, tiny_llama, tmp_path):
    """An idle keep-alive connection (a load balancer's, a client library's)
    stays open across a death: the exit must wait for it (up to the grace, so
    as not to cut a client off), a recovery need not: the process stays."""
    arm = tmp_path / "arm"
    server = servers("0.32.2", tiny_llama, env=_recover_env(arm, MLX_HOTFIX_EXIT_GRACE="60"))
    server.warm_up()
    with socket.create_connection(("127.0.0.1", server.port)) as idle:
        arm_fault(arm)
        assert server.chat(PROMPT + " again", max_tokens=16, timeout=60).status_code == 503
        # Healthy again while the idle connection is still open, long before the
        # 60 s grace an exit would wait for it.
        deadline = time.monotonic() + 40
        while server.health() != 200:
            assert server.alive(), server.log()[-3000:]
            assert time.monotonic() < deadline, "not healthy again:\n" + server.log()[-3000:]
            time.sleep(0.05)
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = idle.makefile("rb").read()
    assert answer.startswith(b"HTTP/1.0 200") or answer.startswith(b"HTTP/1.1 200"), answer
    assert "mlx-hotfix: recovered: a fresh generation loop serves (pid unchanged, model reused)" \
        in server.hotfix_lines()


def test_recover_is_off_by_default_and_says_so(servers, tiny_llama, tmp_path):
    arm = tmp_path / "arm"
    env = fault_env("raise:typeerror:decode:2", arm)
    server = servers("0.32.2", tiny_llama, env=env)
    server.warm_up()
    assert ("recover off (MLX_HOTFIX_RECOVER=exit: a death exits 70)"
            in server.hotfix_lines()[0]), server.hotfix_lines()
    arm.touch()
    assert server.chat(PROMPT, max_tokens=16).status_code == 503
    assert server.wait_exit(60) == 70


def test_a_gpu_fault_exits_70_where_a_slice_error_is_recovered_in_place(
        servers, tiny_llama, tmp_path):
    """After a GPU timeout macOS rejects the process's GPU work (the penalty
    box, omlx #3706): only a new process recovers, so recover never tries."""
    arm = tmp_path / "arm"
    reports = tmp_path / "reports"
    env = fault_env("raise:armed:decode:2", arm)
    env.update(MLX_HOTFIX_RECOVER="thread", MLX_TEST_FAULT_ONESHOT="1", MLX_TEST_TRACE_LOADS="1",
               MLX_HOTFIX_REPORT_DIR=str(reports),
               MLX_HOTFIX_HEARTBEAT_FILE=str(tmp_path / "heartbeat.json"))
    server = servers("0.32.2", tiny_llama, env=env)
    server.warm_up()
    pid = server.proc.pid

    # A slice error (mlx-lm #1505) is recovered in place, as before.
    _die_once(server, arm, "slice")
    assert _content(server.chat(PROMPT, max_tokens=8))
    assert server.proc.pid == pid and server.log().count(LOAD_LINE) == 1

    # A GPU timeout is not: the clients are answered and the process exits 70.
    arm_fault(arm, "gputimeout")
    dying = server.chat(PROMPT + " again", max_tokens=16, timeout=60)
    assert dying.status_code == 503, (dying.status_code, dying.text)
    assert server.wait_exit(60) == 70, server.log()[-3000:]
    lines = server.hotfix_lines()
    assert ("mlx-hotfix: not recovering in place: gpu-timeout (a GPU command buffer ran past the "
            "macOS GPU watchdog) is a GPU fault; only a new process recovers from it") in lines
    assert sum("recovering in place (" in line for line in lines) == 1, lines  # the slice's
    assert lines[-1].startswith("mlx-hotfix: generation thread died: gpu-timeout: RuntimeError: "
                                "[METAL] Command buffer execution failed: Caused GPU Timeout Error"), lines
    assert lines[-1].endswith("; exiting 70"), lines
    assert server.log().count(LOAD_LINE) == 1
    kinds = sorted(name.split("-")[3] for name in os.listdir(reports) if name.endswith(".json"))
    assert kinds == ["died", "recovered"], kinds
    # The report says what it was and why it was not recovered in place.
    (died,) = [json.loads((reports / name).read_text()) for name in os.listdir(reports)
               if "-died-" in name]
    (recovered,) = [json.loads((reports / name).read_text()) for name in os.listdir(reports)
                    if "-recovered-" in name]
    assert recovered["cause"] == "slice" and "recovery_refused" not in recovered
    assert died["cause"] == "gpu-timeout" and died["remedy"].startswith("only a new process")
    assert died["recovery_refused"] == (
        "not recovering in place: gpu-timeout (a GPU command buffer ran past the macOS GPU "
        "watchdog) is a GPU fault; only a new process recovers from it")


def test_which_deaths_recover_refuses_in_place():
    """The decision alone, in the shim's own interpreter (no server): every
    kind the fault injector raises, by the class its real text has."""
    code = r"""
import importlib.util, json, os
spec = importlib.util.spec_from_file_location("faults", os.path.join("harness", "faults", "sitecustomize.py"))
faults = importlib.util.module_from_spec(spec)
spec.loader.exec_module(faults)
from mlx_hotfix.patches import recover
print(json.dumps({kind: recover.cannot_recover_in_place(error(message))
                  for kind, (error, message) in faults._MESSAGES.items()}))
"""
    from harness.server import ROOT, run_python

    run = run_python("0.32.2", code, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    refused = json.loads(run.stdout.strip().splitlines()[-1])
    for kind in ("typeerror", "resource", "slice", "broadcast", "extract"):
        assert refused[kind] is None, (kind, refused[kind])
    for kind, cls in (("gputimeout", "gpu-timeout"), ("penaltybox", "gpu-penalty-box"),
                      ("invalidresource", "gpu-invalid-resource"), ("metaloom", "metal-oom")):
        assert refused[kind].startswith(f"not recovering in place: {cls} ("), refused[kind]
        assert refused[kind].endswith("is a GPU fault; only a new process recovers from it")
    assert refused["ringlost"] == (
        "not recovering in place: ring-peer-lost (a ring peer went away (mlx 0.32.1 and later)) "
        "is a distributed group's failure; only the whole group restarted recovers")
