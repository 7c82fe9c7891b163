"""One smoke per mlx-lm release line, on the real stock servers (issue 12),
plus a stock tree relabelled as a release we have not seen (issue 8).

Each release line runs in its own env with the mlx/transformers pins that
make it run (scripts/setup-envs --matrix). The smoke: the status line reads
true, and one injected death (BatchGenerator.next raises, the step every
threaded release takes) gives the waiting client a 503 and the process
exit 70. Select with ``pytest -m matrix``.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
import requests

from tests.conftest import fault_env
from harness.server import ENVS_DIR, BackgroundRequest, python_for

CLIENT_TIMEOUT = 60

NO_PPB = "extend skipped: no PromptProcessingBatch in this release"
NO_ADVANCE = "advance skipped: no ArraysCache.advance in this release"
EXTEND_FIXED = ("extend skipped: PromptProcessingBatch.extend no longer pads logits "
                "processors with None (fixed upstream in 0.32.0)")

# release line -> what its status line must say (each piece verbatim)
EXPECTED = {
    "0.28.4": ("exit applied;", NO_PPB, NO_ADVANCE),
    "0.29.1": ("exit applied;", NO_PPB, NO_ADVANCE),
    "0.30.7": ("exit applied;", NO_PPB, "advance applied"),
    "0.31.0": ("exit applied;", NO_PPB, "advance applied",
               'WARNING: mlx-lm 0.31.0 was yanked from PyPI: "Batched KV cache cross contamination"'),
    "0.31.2": ("exit applied;", "extend applied;", "advance applied"),
    "0.32.0": ("exit applied;", EXTEND_FIXED, "advance applied"),
    "0.32.2": ("exit applied;", EXTEND_FIXED, "advance applied"),
}

# 0.28.4 defaults repetition_penalty to 1.0, which it cannot batch: such a
# request runs on the generation thread through stream_generate, where stock
# catches a failure per request. Its batched path (the one whose failure kills
# the thread) takes requests with repetition_penalty 0.
REQUEST_EXTRA = {"0.28.4": {"repetition_penalty": 0.0}}


def _status_line(server) -> str:
    lines = [l for l in server.hotfix_lines() if l.startswith("mlx-hotfix: mlx-lm ")]
    assert len(lines) == 1, server.log()
    return lines[0]


def _assert_503_then_70(server, request) -> None:
    assert server.wait_exit(CLIENT_TIMEOUT) == 70, server.log()
    assert request.join(CLIENT_TIMEOUT), request
    assert request.status == 503, (request, server.log())
    error = request.json()["error"]
    assert error["code"] == 503 and "generation thread died" in error["message"]


@pytest.mark.server
@pytest.mark.matrix
@pytest.mark.parametrize("version", list(EXPECTED))
def test_release_line_death_gives_503_and_exit_70(servers, tiny_llama, tmp_path, version):
    python_for(version)  # fails with the setup command when the env is missing
    arm = tmp_path / "arm"
    server = servers(version, tiny_llama, env=fault_env("raise:resource:step:2", arm))
    extra = REQUEST_EXTRA.get(version, {})
    server.warm_up(**extra)
    line = _status_line(server)
    assert line.startswith("mlx-hotfix: mlx-lm %s, mlx " % version), line
    for piece in EXPECTED[version]:
        assert piece in line, (piece, line)
    if "WARNING" not in EXPECTED[version][-1]:
        assert "WARNING" not in line, line  # the pins make a good pair
    arm.touch()
    request = BackgroundRequest(lambda: server.chat("tell me more " * 10, max_tokens=100,
                                                    timeout=CLIENT_TIMEOUT, **extra))
    _assert_503_then_70(server, request)
    died = [l for l in server.hotfix_lines() if "generation thread died" in l]
    assert died == ["mlx-hotfix: generation thread died: metal-buffer-count: RuntimeError: "
                    "[metal::malloc] "
                    "Resource limit (499000) exceeded.; exiting 70"], server.log()


@pytest.mark.server
@pytest.mark.matrix
def test_stock_029_without_the_shim_is_a_zombie(servers, tiny_llama, tmp_path):
    """The control for the request-queue shape: stock 0.29.1 never exits."""
    arm = tmp_path / "arm"
    server = servers("0.29.1", tiny_llama, shim=False,
                     env=fault_env("raise:resource:step:2", arm, shim=False))
    server.warm_up()
    arm.touch()
    request = BackgroundRequest(lambda: server.chat("x", max_tokens=50, timeout=10))
    assert request.join(30)
    assert request.status is None  # no answer: the client timed out
    assert server.wait_exit(3) is None and server.alive()
    assert server.health() == 200


@pytest.mark.server
@pytest.mark.matrix
def test_known_bad_pair_warns_and_its_first_request_death_says_why(servers, tiny_llama):
    """mlx-lm 0.31.0 with mlx 0.32.4, as a plain pip install pairs them."""
    server = servers("0.31.0+mlx-0.32.4", tiny_llama)
    server.wait_listening(120)
    line = _status_line(server)
    assert ("WARNING: mlx-lm 0.31.0 with mlx 0.32.4: the generation thread dies on the first "
            "request (There is no Stream(cpu, 0) in current thread); fix: pip install "
            "'mlx<0.32' (tested: mlx==0.31.2)") in line, line
    assert 'mlx-lm 0.31.0 was yanked from PyPI: "Batched KV cache cross contamination"' in line
    request = BackgroundRequest(lambda: server.chat("hi", timeout=CLIENT_TIMEOUT))
    _assert_503_then_70(server, request)
    notes = [l for l in server.hotfix_lines() if "known-bad pair" in l]
    assert len(notes) == 1 and "There is no Stream(cpu, 0)" in notes[0], server.log()


@pytest.mark.server
@pytest.mark.matrix
def test_known_bad_pair_is_named_by_probe_and_in_the_heartbeat(servers, tiny_llama, tmp_path):
    """Before any request the watchdog can say why this server will die:
    /health and the heartbeat (which `status` reads) carry the warning, and
    `mlx-watchdog probe` prints it, in its JSON line and on stderr."""
    from click.testing import CliRunner

    from mlx_watchdog.cli import main

    beat = tmp_path / "heartbeat.json"
    server = servers("0.31.0+mlx-0.32.4", tiny_llama,
                     env={"MLX_HOTFIX_HEARTBEAT_FILE": str(beat)})
    server.wait_listening(120)
    pair = ("mlx-lm 0.31.0 with mlx 0.32.4: the generation thread dies on the first request "
            "(There is no Stream(cpu, 0) in current thread); fix: pip install 'mlx<0.32'")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        record = json.loads(beat.read_text()) if beat.exists() else {}
        if record.get("phase") == "serving":
            break
        time.sleep(0.2)
    assert record.get("phase") == "serving" and pair in record.get("warning", ""), record
    health = requests.get(server.url + "/health", timeout=10)
    assert health.status_code == 200 and pair in health.json()["warning"], health.text
    assert "yanked" in health.json()["warning"]

    # The probe is this server's first request, and its death: the answer names the cause.
    result = CliRunner().invoke(main, ["probe", "--url", server.url, "--timeout", "60"])
    assert result.exit_code == 1, result.output
    line = json.loads(result.stdout)
    assert line["status"] == "unhealthy" and pair in line["warning"], line
    [said] = result.stderr.strip().splitlines()
    assert said.startswith("WARNING: " + pair), said
    assert server.wait_exit(CLIENT_TIMEOUT) == 70, server.log()


def _relabelled_tree(tmp_path, version="0.33.0"):
    """Stock 0.32.2's mlx_lm package, its _version.py saying a newer release."""
    site = python_for("0.32.2").parent.parent / "lib"
    (source,) = site.glob("python*/site-packages/mlx_lm")
    folder = tmp_path / "relabelled"
    shutil.copytree(source, folder / "mlx_lm", ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "mlx_lm" / "_version.py").write_text('__version__ = "%s"\n' % version)
    return folder


@pytest.mark.server
@pytest.mark.matrix
def test_unseen_release_keeps_every_part_whose_shape_matches(servers, tiny_llama, tmp_path):
    folder = _relabelled_tree(tmp_path)
    arm = tmp_path / "arm"
    beat = tmp_path / "heartbeat.json"
    env = fault_env("raise:resource:step:2", arm)
    env["PYTHONPATH"] += ":" + str(folder)
    env["MLX_HOTFIX_HEARTBEAT_FILE"] = str(beat)
    server = servers("0.32.2", tiny_llama, env=env)
    server.warm_up()
    line = _status_line(server)
    assert line.startswith("mlx-hotfix: mlx-lm 0.33.0, "), line
    assert "exit applied (untested release 0.33.0)" in line, line
    assert "advance applied (untested release 0.33.0)" in line, line
    assert EXTEND_FIXED in line, line
    deadline = time.monotonic() + 30
    while not beat.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    record = json.loads(beat.read_text())
    assert record["phase"] == "serving" and record["beats"] > 0, record
    arm.touch()
    request = BackgroundRequest(lambda: server.chat("tell me more " * 10, max_tokens=100,
                                                    timeout=CLIENT_TIMEOUT))
    _assert_503_then_70(server, request)


def test_matrix_envs_live_with_the_others():
    assert ENVS_DIR.name == ".venvs" or ENVS_DIR.exists()
