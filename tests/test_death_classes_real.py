"""Death classes end to end, on the real stock servers under the real
`mlx-watchdog supervise` (with the shim): each injected death's class shows
in the shim's death line, the 503 body or SSE error event, the crash report
and the restart's cause label; a model whose weights do not match its config
needs attention after three starts, restarts go on at the cap, and fixing
the model clears it.

One supervised server per release dies of several classes in turn (the
``armed`` fault kind: the arm file names the kind; MLX_TEST_FAULT_ONESHOT
disarms it when it strikes, so the restarted server serves).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import requests

from harness.procs import chat
from harness.server import BackgroundRequest, free_port, sse_events
from harness.watchdog_run import wait_serving
from tests.conftest import arm_fault, fault_env
from tests.test_watchdog_real import FAST, LOAD_S, server_command, watchdogs  # noqa: F401

pytestmark = pytest.mark.server

# (fault kind, its class), split between the two releases: each class once.
DEATHS = {
    "0.32.2": (("resource", "metal-buffer-count"), ("metaloom", "metal-oom"),
               ("gputimeout", "gpu-timeout"), ("penaltybox", "gpu-penalty-box"),
               ("invalidresource", "gpu-invalid-resource")),
    "0.31.3": (("slice", "slice"), ("broadcast", "broadcast"), ("extract", "extract"),
               ("typeerror", "extend"), ("ringlost", "ring-peer-lost")),
}


def _told(request: BackgroundRequest) -> dict:
    """The error the client was given: the 503 body's, or the last SSE event's."""
    assert request.join(120), request
    assert request.error is None, request
    if request.status == 503:
        return json.loads(request.body)["error"]
    assert request.status == 200, request
    events = sse_events(request.body)
    assert isinstance(events[-1], dict) and "error" in events[-1], events[-3:]
    return events[-1]["error"]


@pytest.mark.parametrize("version", list(DEATHS))
def test_each_injected_death_is_named_by_its_class_everywhere(
        watchdogs, tiny_llama, tmp_path, version):
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    arm = tmp_path / "arm"
    env = fault_env("raise:armed:decode:2", arm, shim=False)  # supervise adds the shim
    env["MLX_TEST_FAULT_ONESHOT"] = "1"
    sup = watchdogs(["supervise", "--name", "tiny", *FAST, "--backoff-max", "2",
                     "--metrics-port", str(metrics_port), "--",
                     *server_command(version, tiny_llama, port)], env=env)
    wait_serving(url, LOAD_S, log=sup)
    for number, (kind, cls) in enumerate(DEATHS[version]):
        stream = number % 2 == 1  # every other one told by an SSE error event
        arm_fault(arm, kind)
        # Long enough to be in flight when the fault strikes (whoever's step it is).
        request = BackgroundRequest(lambda stream=stream: chat(
            url, "tell me more " * 20, max_tokens=300, stream=stream, timeout=120), name=kind)
        error = _told(request)
        assert error["cause"] == cls and error["type"] == "server_error", (kind, error)
        assert error["code"] == 503 and error["message"].startswith("generation thread died (")
        restart = sup.wait_event(
            lambda e, cls=cls: e["event"] == "restart" and e.get("death_cause") == cls,
            120, f"the restart after {cls}")
        assert restart["cause"] == "exited", restart
        wait_serving(url, LOAD_S, log=sup)

    classes = [cls for _, cls in DEATHS[version]]
    # The shim's death line, in the supervisor's log (the child's output).
    lines = [line for line in sup.text().splitlines() if "generation thread died: " in line]
    for cls in classes:
        assert any(f"mlx-hotfix: generation thread died: {cls}: " in line
                   and line.endswith("; exiting 70") for line in lines), (cls, lines)
    # The crash reports: the class, its remedy and where it comes from.
    reports = [json.loads(p.read_text()) for p in sorted(sup.report_dir.glob("*.json"))]
    died = {r["cause"]: r for r in reports if r.get("kind") == "died"}
    assert sorted(died) == sorted(classes), sorted(died)
    for report in died.values():
        assert report["remedy"] and report["cause_source"], report
    # The restart's cause label (the reason label stays the judge's).
    scrape = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    for cls in classes:
        assert re.search(r'mlx_watchdog_restarts_total\{cause="%s",instance="tiny",'
                         r'reason="exited"\} 1\.0' % re.escape(cls), scrape), cls
    # `reports` lists each with its class; `status` names the last death.
    listing = subprocess.run([sys.executable, "-m", "mlx_watchdog", "reports", "--dir",
                              str(sup.report_dir)], capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.splitlines()[0].split()[5] == "CAUSE"
    for cls in classes:
        assert f" {cls} " in listing.stdout, (cls, listing.stdout)
    sup.wait_for(lambda: (sup.record().get("last_death") or {}).get("cause") == classes[-1], 30,
                 "the last death in the state file")

    # A SIGKILL leaves no word (the OOM killer, jetsam, a person): class
    # killed, with a report the watchdog writes; the kernel's log has no OOM
    # kill of it here, so what is known is the signal.
    child = sup.current_child()
    os.kill(child, signal.SIGKILL)
    sup.wait_event(lambda e: e["event"] == "restart" and e.get("death_cause") == "killed", 120,
                   "the restart after the SIGKILL")
    death = sup.wait_for(lambda: (d := sup.record().get("last_death") or {}).get("pid") == child
                         and d, 30, "the state file to have the SIGKILL")
    assert death["cause"] == "killed", death
    assert death["detail"]["signal"] == 9 and death["exit_code"] == -9, death
    killed = [json.loads(p.read_text()) for p in sup.report_dir.glob(f"*-killed-{child}.json")]
    assert len(killed) == 1 and killed[0]["remedy"].startswith("the kernel's OOM killer")
    wait_serving(url, LOAD_S, log=sup)


def _status_json(sup) -> dict:
    result = subprocess.run([sys.executable, "-m", "mlx_watchdog", "status", "--json",
                             "--state-file", str(sup.state_path)],
                            capture_output=True, text=True, timeout=60)
    return json.loads(result.stdout)["instances"]["qwen"]


def test_a_model_that_does_not_match_its_weights_needs_attention_until_fixed(
        watchdogs, tiny_llama, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    config_path = model / "config.json"
    good = config_path.read_text()
    config = json.loads(good)
    config["num_hidden_layers"] += 1  # its weights have no layer for it: "Missing 9 parameters"
    config_path.write_text(json.dumps(config))
    port = free_port()
    sup = watchdogs(["supervise", "--name", "qwen", *FAST, "--backoff-max", "2", "--",
                     *server_command("0.32.2", model, port)])

    def needs_attention():
        return sup.record().get("needs_attention")

    sup.wait_for(needs_attention, 300, "needs attention after three starts")
    status = _status_json(sup)
    assert status["status"] == "needs-attention", status
    attention = status["needs_attention"]
    assert attention["cause"] == "config-missing-parameters" and attention["starts"] == 3
    assert attention["remedy"].startswith("run the mlx-lm release the model was converted for")
    assert status["last_death"]["cause"] == "config-missing-parameters"
    text = subprocess.run([sys.executable, "-m", "mlx_watchdog", "status", "--state-file",
                           str(sup.state_path)], capture_output=True, text=True, timeout=60)
    assert "needs attention: config-missing-parameters on 3 starts in a row" in text.stdout

    # Restarts go on, at the cap, and the remedy is said once, not at each one.
    exits = len([e for e in sup.events() if e["event"] == "exited"])
    sup.wait_for(lambda: len([e for e in sup.events() if e["event"] == "exited"]) >= exits + 2,
                 120, "two more starts")
    said = [e for e in sup.events() if e["event"] == "needs-attention"]
    assert len(said) == 1 and "run the mlx-lm release" in said[0]["message"], said
    restarts = [e for e in sup.events() if e["event"] == "restart"]
    assert all(e.get("death_cause") == "config-missing-parameters" for e in restarts), restarts

    config_path.write_text(good)  # the operator fixes the model in place
    wait_serving(f"http://127.0.0.1:{port}", LOAD_S, log=sup)
    sup.wait_for(lambda: not needs_attention(), 60, "needs attention to clear")
    assert _status_json(sup)["needs_attention"] is None
    assert _status_json(sup)["status"] == "healthy"
    assert sup.wait_event(lambda e: e["event"] == "needs-attention"
                          and "no longer" in e["message"], 30, "the all-clear")
