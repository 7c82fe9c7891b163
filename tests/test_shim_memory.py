"""Memory in the heartbeat and /health, and the trim the watchdog asks for
through ``<heartbeat>.memory`` (sitecustomize/mlx_hotfix/memory.py).

On the real stock servers with the shim: the record carries the process's
memory (RSS on Linux; macOS adds phys_footprint, see test_macos.py for the
struct), MLX's allocator figures and the prompt cache's; a trim request
halves the prompt cache and is reported in the next beat; the soft line
turns /health 503 {"status": "memory"} for as long as the request says
(/health/live stays 200 "serving"), and
a request for another process, or a hostile file, does nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from harness.server import SHIM_DIR, VERSIONS, base_env
from mlx_watchdog.memory import parse_heartbeat_memory
from tests.test_shim_stall import health, live, read, wait_for

MEASURED = {"rss", "mlx_active", "mlx_cache", "mlx_peak", "prompt_cache_bytes",
            "prompt_cache_entries"}


def _request(beat_file, **fields):
    path = f"{beat_file}.memory"
    temporary = f"{path}.tmp"
    with open(temporary, "w") as handle:
        json.dump(fields, handle)
    os.replace(temporary, path)  # as the watchdog writes it: whole or not at all


@pytest.mark.server
@pytest.mark.parametrize("version", VERSIONS)
def test_memory_in_the_beat_and_health_and_a_trim_on_request(servers, tiny_llama, tmp_path,
                                                            version):
    beat_file = tmp_path / "heartbeat.json"
    server = servers(version, tiny_llama, env={
        "MLX_HOTFIX_HEARTBEAT_FILE": str(beat_file), "MLX_HOTFIX_HEARTBEAT_INTERVAL": "0.2",
        "MLX_HOTFIX_REPORT_DIR": str(tmp_path / "reports")})
    server.warm_up()
    for i in range(6):  # distinct prompts: one prompt-cache entry each
        assert server.chat(f"prompt {i}: " + "lorem ipsum " * 20, max_tokens=4).status_code == 200
    memory = wait_for(lambda: (read(beat_file) or {}).get("memory", {}).get(
        "prompt_cache_entries", 0) >= 6 and read(beat_file)["memory"], 30, "six cache entries")
    assert set(memory) == MEASURED, memory  # Linux: no phys_footprint, nothing written as 0
    assert all(isinstance(memory[k], int) for k in MEASURED)
    assert memory["rss"] > 10 << 20 and memory["mlx_active"] > 0
    assert memory["prompt_cache_bytes"] > 0 and memory["mlx_peak"] >= memory["mlx_active"]
    status, body = health(server)
    assert status == 200 and body["status"] == "ok" and set(body["memory"]) == MEASURED

    # A request for another process (a file left from an earlier server): nothing.
    _request(beat_file, pid=server.proc.pid + 1, trim=1, soft_until=time.time() + 60)
    time.sleep(1.0)  # five beats
    assert "trimmed" not in read(beat_file)["memory"] and health(server)[0] == 200

    before = read(beat_file)["memory"]
    _request(beat_file, pid=server.proc.pid, trim=7, soft_until=time.time() + 60)
    after = wait_for(lambda: read(beat_file)["memory"].get("trimmed") and read(beat_file)["memory"],
                     30, "the trim to be reported")
    trimmed = after["trimmed"]
    assert trimmed["request"] == 7 and trimmed["prompt_cache_entries"] >= 1
    assert after["prompt_cache_bytes"] <= before["prompt_cache_bytes"] // 2
    assert trimmed["prompt_cache_bytes"] == before["prompt_cache_bytes"] - after[
        "prompt_cache_bytes"]
    assert "mlx_cache_bytes" in trimmed and after["mlx_cache"] == 0  # mx.clear_cache()
    seen = parse_heartbeat_memory(after)  # the other side of the seam: the watchdog's reader
    assert seen.trimmed_request == 7 and seen.prompt_cache_bytes == after["prompt_cache_bytes"]
    assert seen.trimmed_bytes == trimmed["prompt_cache_bytes"] + trimmed["mlx_cache_bytes"]
    assert [line for line in server.hotfix_lines() if "memory: trimmed on request 7" in line]
    status, body = health(server)
    assert (status, body["status"]) == (503, "memory") and body["memory"]["trimmed"] == trimmed
    # Not ready, but alive and serving: a liveness probe must not kill it.
    assert live(server) == (200, {"status": "alive", "phase": "serving"})

    # The same request number again (the soft line renewed): no second trim;
    # the soft line lapses when the watchdog says so.
    _request(beat_file, pid=server.proc.pid, trim=7, soft_until=time.time() - 1)
    wait_for(lambda: health(server)[0] == 200, 30, "/health to say 200 again")
    assert server.chat("after the trim", max_tokens=4).status_code == 200
    assert read(beat_file)["memory"]["trimmed"] == trimmed
    assert sum("memory: trimmed" in line for line in server.hotfix_lines()) == 1


HOSTILE_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from mlx_hotfix import memory
    folder = sys.argv[1]
    pid, now = 4242, 1000.0
    def request(name, content=None, make=None):
        path = os.path.join(folder, name)
        if make is not None:
            make(path)
        else:
            with open(path, "w") as handle:
                handle.write(content)
        return memory.read_request(path, pid, now)

    good = json.dumps({"pid": pid, "trim": 3, "soft_until": 1010.5})
    with open(os.path.join(folder, "target"), "w") as handle:
        handle.write(good)
    out = {
        "good": request("good", good),
        "far_future": request("far", json.dumps({"pid": pid, "soft_until": 1e12})),
        "other_pid": request("other", json.dumps({"pid": 1, "trim": 3})),
        "pid_as_bool": request("bool", json.dumps({"pid": True, "trim": 3})),
        "bad_values": request("bad", json.dumps({"pid": pid, "trim": -1, "soft_until": "soon"})),
        "nan": request("nan", '{"pid": 4242, "soft_until": NaN}'),
        "garbage": request("garbage", "not json at all"),
        "a_list": request("list", "[4242]"),
        "too_big": request("big", json.dumps({"pid": pid, "trim": 1, "pad": "x" * 5000})),
        "symlink": request("link", make=lambda p: os.symlink(os.path.join(folder, "target"), p)),
        "fifo": request("fifo", make=os.mkfifo),
        "directory": request("dir", make=os.mkdir),
        "missing": memory.read_request(os.path.join(folder, "none"), pid, now),
    }
    print(json.dumps(out))
""")


def test_the_request_file_resists_a_hostile_writer(tmp_path):
    # A FIFO must not block the reader (O_NONBLOCK), a link is not followed
    # (O_NOFOLLOW), and nothing but a small JSON object for this pid counts.
    result = subprocess.run([sys.executable, "-c", HOSTILE_SCRIPT, str(tmp_path)],
                            env=base_env(extra={"PYTHONPATH": str(SHIM_DIR)}),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out.pop("good") == {"trim": 3, "soft_until": 1010.5}
    assert out.pop("far_future") == {"trim": None, "soft_until": 1000.0 + 600.0}
    assert out.pop("bad_values") == {"trim": None, "soft_until": None}
    assert out.pop("nan") == {"trim": None, "soft_until": None}
    assert out == dict.fromkeys(out, None), out


SAMPLING_SCRIPT = textwrap.dedent("""
    import json, sys
    from mlx_hotfix import memory

    class Cache:  # counts how often the sampler looks
        looks = 0
        nbytes = 1000
        def __len__(self):
            Cache.looks += 1
            return 3

    class Generator:
        prompt_cache = Cache()

    out = {"bare": memory.fields()}  # no mlx.core imported, no generator attached
    generator = Generator()
    memory.attach(generator)  # a new generator: the next call samples afresh
    first = memory.fields()
    for _ in range(100):
        memory.fields()
    out["first"] = first
    out["looks"] = Cache.looks
    print(json.dumps(out))
""")


def test_sampling_costs_one_look_per_interval_and_leaves_out_what_it_cannot_have(tmp_path):
    result = subprocess.run([sys.executable, "-c", SAMPLING_SCRIPT],
                            env=base_env(extra={"PYTHONPATH": str(SHIM_DIR),
                                                "MLX_HOTFIX_HEARTBEAT_INTERVAL": "3600"}),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(out["bare"]) == {"rss"}  # no MLX, no prompt cache: absent, never 0
    assert out["first"] == {"rss": out["first"]["rss"], "prompt_cache_bytes": 1000,
                            "prompt_cache_entries": 3}
    assert out["looks"] == 1  # 101 calls within one interval: one look
