"""Death classes (signatures.py) wired into the watchdog: the class of a
supervised child's exit, the restart's cause label, status, and needs
attention (attention.py) in the monitor. Supervisor.tick with fakes (the
real servers: tests/test_death_classes_real.py)."""

from __future__ import annotations

import json
import logging

from mlx_watchdog import oomkill, reports
from mlx_watchdog.judge import HEALTHY
from mlx_watchdog.probe import UNREACHABLE, ProbeResult
from mlx_watchdog.status_view import format_status
from tests.test_supervise import GOOD, make

DOWN_PROBE = ProbeResult(UNREACHABLE, 0.0, reason="connection refused")


def _dies_of(supervisor, tmp_path, cause, code=70, summary="ValueError: boom"):
    """The current child leaves the shim's death record, then exits."""
    child = supervisor.child
    death = {"summary": summary, "during_startup": True, "time": 1.0, "cause": cause}
    (tmp_path / "heartbeat.json").write_text(json.dumps({"pid": child.pid, "death": death}))
    child.code = code


def _until_restarted(supervisor, spawner, clock, ticks=50):
    before = len(spawner.children)
    for _ in range(ticks):
        supervisor.tick()
        if len(spawner.children) > before:
            return
        clock.now += 30
    raise AssertionError("no restart")


def _metrics(supervisor):
    return supervisor.monitor.metrics.render().decode()


def test_the_deaths_class_labels_the_restart_and_shows_in_status(tmp_path):
    supervisor, spawner, *_ = make(tmp_path)
    supervisor.start()
    assert supervisor.tick().state == HEALTHY
    _dies_of(supervisor, tmp_path, "metal-oom",
             summary="RuntimeError: [METAL] Command buffer execution failed: Insufficient Memory")
    supervisor.tick()
    assert len(spawner.children) == 2
    assert ('mlx_watchdog_restarts_total{cause="metal-oom",instance="test",reason="exited"} 1.0'
            in _metrics(supervisor))
    death = supervisor.monitor.record()["last_death"]
    assert death["cause"] == "metal-oom" and death["exit_code"] == 70
    assert death["remedy"].startswith("only a new process recovers")
    assert supervisor.monitor.record()["last_restart"]["death_cause"] == "metal-oom"
    assert supervisor.monitor.record()["needs_attention"] is None  # a restart helps


def test_status_shows_the_last_death_and_needs_attention():
    now = 1_000_000.0
    record = {"state": "crash-looping", "reason": "server exited", "since": now - 60,
              "restarts": 4, "updated": now, "interval_s": 5,
              "last_restart": {"time": now - 5, "cause": "exited", "ok": True, "detail": "x",
                               "death_cause": "config-missing-parameters"},
              "last_death": {"cause": "config-missing-parameters", "time": now - 6,
                             "title": "the weights do not match this mlx-lm's model",
                             "remedy": "run the mlx-lm release the model was converted for",
                             "source": "mlx-lm #1493"},
              "needs_attention": {"cause": "config-missing-parameters", "since": now - 30,
                                  "message": "needs attention: config-missing-parameters on 3 "
                                             "starts in a row, and a restart cannot fix it; "
                                             "run the mlx-lm release"}}
    text = format_status({"instances": {"m": record}}, now=now, pid_alive=lambda pid: True)
    row = text.splitlines()[1]
    assert row.split()[1:3] == ["needs-attention", "1m00s"], row
    assert "exited: config-missing-parameters 5s ago" in row
    assert ("  needs attention: config-missing-parameters on 3 starts in a row, and a restart "
            "cannot fix it; run the mlx-lm release (since 30s ago)") in text
    assert "  last death: config-missing-parameters (the weights do not match" in text
    assert "    remedy: run the mlx-lm release the model was converted for" in text
    assert "    upstream: mlx-lm #1493" in text


def test_a_sigkill_without_a_word_is_killed_with_the_oom_killers_record(tmp_path, monkeypatch):
    supervisor, spawner, *_ = make(tmp_path)
    supervisor.start()
    supervisor.tick()
    pid = supervisor.child.pid
    line = (f"Out of memory: Killed process {pid} (python3) total-vm:9000kB, anon-rss:8000kB, "
            "file-rss:0kB")
    looked_up = []

    def find(wanted):
        looked_up.append(wanted)
        return oomkill.parse_oom_kill(wanted, [line], "dmesg")

    monkeypatch.setattr(oomkill, "find_oom_kill", find)
    supervisor.child.code = -9  # no heartbeat death: the shim never saw it coming
    supervisor.tick()
    death = supervisor.monitor.record()["last_death"]
    assert looked_up == [pid]
    assert death["cause"] == "killed" and death["detail"]["signal"] == 9
    assert death["detail"]["by"] == "oom-killer" and death["detail"]["anon_rss_kb"] == 8000
    assert 'cause="killed",instance="test",reason="exited"} 1.0' in _metrics(supervisor)
    # It left no report of its own: the watchdog writes one, and lists it.
    (report,) = reports.load_reports(tmp_path / "reports")
    assert report["kind"] == "killed" and report["cause"] == "killed"
    assert report["cause_detail"]["by"] == "oom-killer" and report["pid"] == pid
    assert report["instance"]["name"] == "test"
    assert reports.format_table([report]).splitlines()[1].split()[5:7] == ["killed", "killed"]
    assert "- **what is known:** " in reports.format_markdown(report)


def test_an_unexplained_exit_is_classified_from_the_childs_output(tmp_path):
    supervisor, spawner, *_ = make(tmp_path)
    supervisor.start()
    supervisor.tick()
    child = supervisor.child
    child.output_tail = lambda: ("libc++abi: terminating due to uncaught exception of type "
                                 "std::runtime_error: [METAL] Command buffer execution failed: "
                                 "Caused GPU Timeout Error "
                                 "(00000002:kIOGPUCommandBufferCallbackErrorTimeout).\n")
    child.code = -6
    supervisor.tick()
    assert supervisor.monitor.record()["last_death"]["cause"] == "gpu-timeout"


def test_three_starts_that_a_restart_cannot_fix_need_attention_until_one_serves(
        tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mlx_watchdog")
    supervisor, spawner, probes, _, clock = make(tmp_path, backoff=1.0)
    policy = supervisor.monitor.policy
    policy.backoff_max_s = 60.0
    probes.next = DOWN_PROBE
    supervisor.start()
    for start in range(1, 6):
        _dies_of(supervisor, tmp_path, "config-missing-parameters",
                 summary="ValueError: Missing 9 parameters")
        _until_restarted(supervisor, spawner, clock)
        attention = supervisor.monitor.record()["needs_attention"]
        if start < 3:
            assert attention is None and not policy.at_cap, start
            continue
        assert attention["cause"] == "config-missing-parameters" and attention["starts"] == start
        assert attention["remedy"].startswith("run the mlx-lm release the model was converted")
        # Restarts go on, at the cap: never down for good, never faster.
        assert policy.at_cap and policy.backoff_s() == 60.0
    said = [r.getMessage() for r in caplog.records if "needs attention" in r.getMessage()]
    assert len(said) == 1 and "run the mlx-lm release" in said[0], said  # once, not each time
    assert 'mlx_watchdog_needs_attention{instance="test"} 1.0' in _metrics(supervisor)
    record = json.loads(json.dumps(supervisor.monitor.record()))  # as the state file has it
    assert record["needs_attention"]["cause"] == "config-missing-parameters"
    assert "needs attention" in format_status({"instances": {"test": record}},
                                              now=clock.now, pid_alive=lambda pid: True)

    # The operator fixes the model folder: the next start serves, and it clears.
    probes.next = GOOD
    assert supervisor.tick().state == HEALTHY
    assert supervisor.monitor.record()["needs_attention"] is None and not policy.at_cap
    assert 'mlx_watchdog_needs_attention{instance="test"} 0.0' in _metrics(supervisor)
    assert any("no longer needs attention" in r.getMessage() for r in caplog.records)


def test_a_death_a_restart_can_fix_breaks_the_run(tmp_path):
    supervisor, spawner, probes, _, clock = make(tmp_path)
    probes.next = DOWN_PROBE
    supervisor.start()
    for cause in ("config-model-path", "config-model-path", "metal-buffer-count",
                  "config-model-path", "config-model-path"):
        _dies_of(supervisor, tmp_path, cause)
        _until_restarted(supervisor, spawner, clock)
    assert supervisor.monitor.record()["needs_attention"] is None


def test_a_supervised_groups_ring_failure_names_the_rank_and_host_that_failed(tmp_path):
    """An mlx.launch child: the survivors' own lines (the shim's death line,
    prefixed with their rank and host) name the one rank that did not report."""
    supervisor, spawner, *_ = make(tmp_path)
    supervisor.command = ["mlx.launch", "--backend", "ring", "--hosts",
                          "studio-1,studio-2,studio-3", "--", "mlx_lm.server", "--port", "8080"]
    supervisor.start()
    supervisor.tick()
    child = supervisor.child
    child.output_tail = lambda: (
        "mlx-hotfix: [rank 0 on studio-1] generation thread died: ring-peer-lost: RuntimeError: "
        "[ring] connection to a peer was lost; exiting 70\n"
        "mlx-hotfix: [rank 2 on studio-3] generation thread died: ring-peer-lost: RuntimeError: "
        "[ring] connection to a peer was lost; exiting 70\n")
    child.code = 70
    supervisor.tick()
    death = supervisor.monitor.record()["last_death"]
    assert death["cause"] == "ring-peer-lost"
    assert death["detail"]["failed_rank"] == 1 and death["detail"]["failed_host"] == "studio-2"
    assert death["detail"]["reported_by"] == [0, 2]
    text = format_status({"instances": {"g": dict(supervisor.monitor.record(), updated=1e9,
                                                  interval_s=5)}},
                         now=1e9, pid_alive=lambda pid: True)
    assert "failed_host=studio-2" in text and "failed_rank=1" in text, text


def test_watch_learns_each_death_from_the_heartbeat_and_needs_attention(tmp_path, caplog):
    """`watch` (an installed instance: launchd or systemd restarts the server):
    the shim's last heartbeat record of each process names its death."""
    from harness.fakes import Clock, FakeProcess
    from mlx_watchdog.judge import Judge, JudgeConfig
    from mlx_watchdog.metrics import Metrics
    from mlx_watchdog.monitor import Monitor
    from mlx_watchdog.policy import RestartPolicy

    caplog.set_level(logging.INFO, logger="mlx_watchdog")
    clock = Clock(1000.0)
    heartbeat = tmp_path / "heartbeat.json"
    probes = iter([DOWN_PROBE] * 8 + [GOOD])
    monitor = Monitor("qwen", lambda: next(probes), judge=Judge(JudgeConfig(failures=2)),
                      policy=RestartPolicy(boot_grace_s=600), action=None,
                      heartbeat_file=heartbeat, process=FakeProcess(0.0), metrics=Metrics(),
                      clock=clock, wall_clock=clock)
    monitor.started()
    for pid in (101, 102, 103):
        record = {"pid": pid, "death": {"summary": "FileNotFoundError: [Errno 2] No such file "
                                        "or directory: '/m/config.json'",
                                        "during_startup": True, "time": clock.now,
                                        "cause": "config-model-path"}}
        heartbeat.write_text(json.dumps(record))
        monitor.tick()
        monitor.tick()  # the same record again: the same death, not another
        clock.now += 10
    assert monitor.record()["last_death"]["cause"] == "config-model-path"
    attention = monitor.record()["needs_attention"]
    assert attention["cause"] == "config-model-path" and attention["starts"] == 3
    assert 'mlx_watchdog_needs_attention{instance="qwen"} 1.0' in monitor.metrics.render().decode()
    assert len([r for r in caplog.records if "needs attention:" in r.getMessage()]) == 1
    heartbeat.write_text(json.dumps({"pid": 104}))  # the model was fixed: it serves
    while monitor.tick().state != HEALTHY:
        pass
    assert monitor.record()["needs_attention"] is None


def test_the_shims_class_of_a_death_and_the_fields_a_report_gets():
    """In the shim's own interpreter (no server): the class, the report's
    fields (no request text in the detail), and a known-bad pair's fallback."""
    code = r"""
import json
from mlx_hotfix.patches import exit as e
out = {}
out["oom"] = e.cause_fields(e.classify_death(RuntimeError(
    "[metal::malloc] Attempting to allocate 900 bytes which is greater than the maximum "
    "allowed buffer size of 100 bytes.")))
out["stream"] = e.cause_name(e.classify_death(RuntimeError(
    "There is no Stream(cpu, 0) in current thread.")))
e._known_bad_pair = lambda: True
odd = RuntimeError("something new")
out["odd_pair"] = e.cause_name(e.classify_death(odd, bad_pair=True))
out["odd_loading"] = e.cause_name(e.classify_death(odd, bad_pair=False))
out["none"] = e.cause_fields(None)
print(json.dumps(out))
"""
    from harness.server import ROOT, run_python

    run = run_python("0.32.2", code, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["oom"]["cause"] == "metal-too-big"
    assert out["oom"]["cause_detail"] == {"bytes": 900, "max_bytes": 100}
    assert out["oom"]["remedy"].startswith("a single request needs too large a buffer")
    assert out["oom"]["cause_source"] == "mlx backend/metal/allocator.cpp:116"
    assert out["stream"] == "config-bad-pair"
    assert out["odd_pair"] == "config-bad-pair" and out["odd_loading"] == "unknown"
    assert out["none"] == {"cause": "unknown"}
