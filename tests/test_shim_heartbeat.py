"""The shim's heartbeat file, on the real stock server and around model loads."""

from __future__ import annotations

import json
import sys
import textwrap
import time

import pytest

from harness.server import SHIM_DIR, VERSIONS, base_env

import subprocess


def _read(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.server
@pytest.mark.parametrize("version", VERSIONS)
def test_the_loop_beats_while_idle_and_serving(servers, tiny_llama, tmp_path, version):
    beat_file = tmp_path / "heartbeat.json"
    server = servers(version, tiny_llama, env={"MLX_HOTFIX_HEARTBEAT_FILE": str(beat_file),
                                               "MLX_HOTFIX_HEARTBEAT_INTERVAL": "0.2"})
    server.warm_up()
    first = _read(beat_file)
    assert first["phase"] == "serving" and first["pid"] == server.proc.pid
    time.sleep(1.5)  # idle: the loop still iterates ~10 times a second
    idle = _read(beat_file)
    assert idle["beats"] > first["beats"] and idle["time"] > first["time"]
    assert server.chat("go on", max_tokens=300).status_code == 200
    assert _read(beat_file)["beats"] > idle["beats"]


MODEL_LOAD_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, time
    from mlx_hotfix import heartbeat
    path = os.environ["MLX_HOTFIX_HEARTBEAT_FILE"]
    read = lambda: json.load(open(path))

    class Generator:  # stands in for ResponseGenerator on its own thread
        _generation_thread = threading.current_thread()

    heartbeat.generation_thread_started(Generator())
    phases = [read()["phase"]]
    heartbeat.loop_iteration()
    phases.append(read()["phase"])
    with heartbeat.model_load():
        before = read()["time"]
        time.sleep(1.0)  # a slow load: no loop iterations at all
        during = read()
        phases.append(during["phase"])
        kept_fresh = during["time"] > before
    phases.append(read()["phase"])
    print(json.dumps({"phases": phases, "kept_fresh": kept_fresh}))
""")


def test_a_model_load_inside_the_loop_reads_as_loading_not_stuck(tmp_path):
    env = base_env(extra={"PYTHONPATH": str(SHIM_DIR),
                          "MLX_HOTFIX_HEARTBEAT_FILE": str(tmp_path / "hb.json"),
                          "MLX_HOTFIX_HEARTBEAT_INTERVAL": "0.1"})
    result = subprocess.run([sys.executable, "-c", MODEL_LOAD_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome == {"phases": ["loading", "serving", "loading", "serving"],
                       "kept_fresh": True}


STALL_SCRIPT = textwrap.dedent("""
    import json, os, threading, time
    from mlx_hotfix import heartbeat
    path = os.environ["MLX_HOTFIX_HEARTBEAT_FILE"]
    read = lambda: json.load(open(path))
    out = {}

    class Generator:
        _generation_thread = threading.current_thread()

    heartbeat.generation_thread_started(Generator())
    turning = threading.Event()
    turning.set()

    def loop():  # a livelock: the loop turns, nothing is delivered
        while True:
            turning.wait()
            heartbeat.loop_iteration()
            time.sleep(0.02)

    threading.Thread(target=loop, daemon=True).start()
    time.sleep(1.5)
    out["idle"] = (heartbeat.health()[0], read()["phase"])
    heartbeat.request_started()
    heartbeat.delivered("prompt")
    out["serving"] = heartbeat.health()
    time.sleep(1.5)
    out["livelock"] = (heartbeat.health()[0], read()["phase"], read()["in_flight"])
    heartbeat.delivered("token")  # progress again
    out["delivering"] = (heartbeat.health()[0], heartbeat.phase())
    heartbeat.request_finished()
    turning.clear()  # a hard hang: the loop stops, nobody in flight
    time.sleep(1.8)
    out["hung"] = (heartbeat.health()[0], read()["phase"])
    out["record"] = sorted(read())
    print(json.dumps(out))
""")


def test_stalled_from_no_delivery_while_turning_and_from_a_loop_that_stopped(tmp_path):
    env = base_env(extra={"PYTHONPATH": str(SHIM_DIR),
                          "MLX_HOTFIX_HEARTBEAT_FILE": str(tmp_path / "hb.json"),
                          "MLX_HOTFIX_HEARTBEAT_INTERVAL": "0.1",
                          "MLX_HOTFIX_STALL_TIMEOUT": "1"})
    result = subprocess.run([sys.executable, "-c", STALL_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["idle"] == [200, "serving"]
    status, body = out["serving"]
    assert status == 200 and body["status"] == "ok" and body["in_flight"] == 1
    assert out["livelock"] == [503, "stalled", 1]
    assert out["delivering"] == [200, "serving"]
    assert out["hung"] == [503, "stalled"]
    assert out["record"] == sorted([
        "pid", "started", "beats", "time", "phase", "in_flight", "delivered",
        "last_delivery", "prompt_tokens", "decode_tokens", "requests", "cancelled",
        "rank", "host", "memory"])
    assert "stalled: 1 request(s) in flight" in result.stderr
