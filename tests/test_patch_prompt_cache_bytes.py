"""prompt_cache_bytes: ``--prompt-cache-bytes`` does not bound the prompt
cache (upstream #1390), on the real stock servers, then with the fix.

The prompt cache's bytes are read from the shim's heartbeat
(``memory.prompt_cache_bytes``, the LRUPromptCache's own ``nbytes``), with
the ``prompt_cache_bytes`` part disabled (stock behaviour) and enabled.
With ``--prompt-cache-bytes 300000`` and entries of ~100 kB (tiny llama,
prompts of ~250 tokens), stock 0.31.3 and 0.32.2:

- **after a burst** of 8 concurrent requests the cache holds every one of
  them (~0.8 MB, over twice the limit) from the moment they finish, because
  finished requests' caches are inserted untrimmed; the only trim runs when
  a request *joins* a batch, so it stays over the limit, idle, until the
  next request comes (here: several heartbeats; in production: all night);
  that trim brings it down, and what the joining request inserts once done
  goes in untrimmed again (so it may end above the limit once more);
- **one request at a time** (``seed`` set, served by ``_serve_single``: also
  ``--kv-bits``, images, a draft model) never trims: 5 requests, 5 entries
  over the limit, growing to ``--prompt-cache-size`` entries whatever their
  bytes.

Fixed: the heartbeat never shows more than the limit, during the burst,
idle, or one request at a time, and every answer is identical to stock's.

The burst is made to overlap, not left to timing: the first request's first
decode step waits (the harness fault ``hold:decode``) until the other seven
are in the server, so all eight join the batch before any finishes (stock's
loop takes every waiting request before its next step). Left to timing, a
loaded machine served them apart, and the trim at each join hid the bug.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

import requests

from harness.server import VERSIONS, BackgroundRequest, run_python
from tests.conftest import arm_fault, fault_env
from tests.test_shim_stall import read

pytestmark = pytest.mark.server

LIMIT = 300_000
FILLER = "lorem ipsum dolor sit amet " * 12  # ~250 tokens: ~100 kB of cache each


class CacheWatch:
    """Reads the heartbeat over and over: the largest prompt cache it saw."""

    def __init__(self, beat_file):
        self.beat_file = beat_file
        self.largest = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> int:
        return ((read(self.beat_file) or {}).get("memory") or {}).get("prompt_cache_bytes", 0)

    def _run(self):
        while not self._stop.is_set():
            self.largest = max(self.largest, self.now())
            time.sleep(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(10)
        return self.largest


def _content(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def _settled(beat_file) -> None:
    """Until the loop wrote two heartbeats more: the record then shows every
    insert of the requests already answered (stock inserts a finished
    request's cache on the loop thread, just after its last answer)."""
    def beats() -> int:
        return (read(beat_file) or {}).get("beats", 0)

    start = beats()
    deadline = time.monotonic() + 120
    while beats() < start + 2:
        assert time.monotonic() < deadline, "the heartbeat stopped"
        time.sleep(0.05)


def _in_flight(server) -> int:
    return requests.get(f"{server.url}/health", timeout=10).json().get("in_flight", 0)


def _until(condition, what, server) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline and server.alive(), f"never {what}:\n{server.log()}"
        time.sleep(0.05)


def scenario(server, beat_file, arm, release) -> dict:
    """The same requests against one server; what its prompt cache did."""
    server.warm_up()
    watch = CacheWatch(beat_file)
    out = {}

    def ask(i):
        return BackgroundRequest(lambda: server.chat(f"burst {i}: {FILLER}", max_tokens=8))

    arm_fault(arm)  # the next decode step waits for the release file
    burst = [ask(0)]
    _until(lambda: "mlx-test-fault: hold at decode" in server.log(), "the first one held", server)
    burst += [ask(i) for i in range(1, 8)]
    _until(lambda: _in_flight(server) == 8, "all eight in the server", server)
    release.touch()
    assert all(request.join(300) for request in burst)
    out["burst"] = [_content(request.response) for request in burst]
    _settled(beat_file)
    out["after_burst"] = watch.now()
    beats = read(beat_file)["beats"]
    while read(beat_file)["beats"] < beats + 5:  # idle, five beats on
        time.sleep(0.1)
    out["idle"] = watch.now()
    out["joined"] = _content(server.chat(f"one more: {FILLER}", max_tokens=8))
    _settled(beat_file)
    out["after_join"] = watch.now()
    out["single"] = [_content(server.chat(f"single {i}: {FILLER}", max_tokens=8, seed=1))
                     for i in range(5)]
    _settled(beat_file)
    out["after_single"] = watch.now()
    out["largest"] = watch.stop()
    return out


@pytest.fixture(scope="module", params=VERSIONS)
def stock_and_fixed(request, envs, tiny_llama, tmp_path_factory):
    from harness.server import StockServer

    version = request.param
    runs = {}
    for mode, disable in (("stock", "prompt_cache_bytes"), ("fixed", "")):
        folder = tmp_path_factory.mktemp(f"{mode}-{version}")
        beat_file = folder / "heartbeat.json"
        arm, release = folder / "arm", folder / "release"
        env = {**fault_env("hold:decode", arm), "MLX_TEST_FAULT_RELEASE_FILE": str(release),
               "MLX_TEST_FAULT_ONESHOT": "1",
               "MLX_HOTFIX_HEARTBEAT_FILE": str(beat_file), "MLX_HOTFIX_HEARTBEAT_INTERVAL": "0.1",
               "MLX_HOTFIX_REPORT_DIR": str(folder / "reports"), "MLX_HOTFIX_DISABLE": disable}
        with StockServer(version, tiny_llama, folder, env=env,
                         args=["--prompt-cache-bytes", str(LIMIT)]) as server:
            runs[mode] = scenario(server, beat_file, arm, release)
            runs[mode + "_status"] = server.hotfix_lines()[0]
    return version, runs


def test_stock_holds_a_burst_over_the_limit_until_the_next_request_joins(stock_and_fixed):
    _, runs = stock_and_fixed
    stock = runs["stock"]
    assert "prompt_cache_bytes disabled" in runs["stock_status"]
    assert stock["after_burst"] > 2 * LIMIT, stock  # all 8 inserted untrimmed
    assert stock["idle"] == stock["after_burst"]  # and kept while idle
    # The one trim: a request joins a batch (then its own cache goes in
    # untrimmed: up to a few entries over the limit again).
    assert stock["after_join"] < stock["idle"], stock


def test_stock_never_trims_requests_served_one_at_a_time(stock_and_fixed):
    _, runs = stock_and_fixed
    assert runs["stock"]["after_single"] > LIMIT, runs["stock"]


def test_fixed_the_limit_holds_at_every_moment(stock_and_fixed):
    _, runs = stock_and_fixed
    fixed = runs["fixed"]
    assert "prompt_cache_bytes applied" in runs["fixed_status"]
    assert 0 < fixed["largest"] <= LIMIT, fixed
    assert fixed["after_single"] > 0  # still caching, within the limit


def test_fixed_answers_are_identical_to_stock(stock_and_fixed):
    _, runs = stock_and_fixed
    for key in ("burst", "joined", "single"):
        assert runs["fixed"][key] == runs["stock"][key], key


def test_the_gate_reads_the_buggy_construction_from_the_installed_source(envs):
    code = ("import sys, mlx_lm.server, mlx_hotfix.patches.prompt_cache_bytes as p; "
            "print(p.check_shape(sys.modules['mlx_lm.server']))")
    for version in VERSIONS:
        result = run_python(version, code, env={"MLX_HOTFIX_DISABLE": "prompt_cache_bytes"})
        assert result.stdout.strip() == "None", (version, result.stderr)


BOUND_SCRIPT = """
import json, types
from mlx_lm.models.cache import LRUPromptCache
from mlx_hotfix.patches.prompt_cache_bytes import bound
provider = lambda limit: types.SimpleNamespace(cli_args=types.SimpleNamespace(
    prompt_cache_bytes=limit))
out = {}
for name, cache, limit in (("flag", LRUPromptCache(10), 1000),
                           ("no_flag", LRUPromptCache(10), None),
                           ("tighter_already", LRUPromptCache(10, max_bytes=500), 1000)):
    bound(cache, provider(limit))
    out[name] = cache.max_bytes
print(json.dumps(out))
"""


def test_the_bound_is_the_flag_or_a_tighter_one_given(envs):
    result = run_python("0.32.2", BOUND_SCRIPT, env={"MLX_HOTFIX": "0"})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"flag": 1000, "no_flag": 1 << 63,
                                         "tighter_already": 500}
