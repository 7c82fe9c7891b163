"""act: restart actions with fake runners and process tables."""

from __future__ import annotations

import os
import subprocess
from collections import namedtuple
from typing import List

import psutil
import pytest

from mlx_watchdog.act import (
    CommandRestart,
    LaunchdRestart,
    SignalRestart,
    SystemdRestart,
)
from mlx_watchdog.process import CpuSampler, ProcessLocator, ProcessNotFound

CpuTimes = namedtuple("CpuTimes", "user system")


class FakeRunner:
    def __init__(self, returncode=0, stdout="", stderr="", raises=None):
        self.calls: List[tuple] = []
        self.returncode, self.stdout, self.stderr, self.raises = returncode, stdout, stderr, raises

    def __call__(self, argv, timeout):
        self.calls.append((argv, timeout))
        if self.raises is not None:
            raise self.raises
        return subprocess.CompletedProcess(argv, self.returncode, self.stdout, self.stderr)


class FakeProc:
    def __init__(self, pid, cmdline=(), cpu=0.0, children=(), ignores_term=False, created=1.0):
        self.pid = pid
        self._cmdline = list(cmdline)
        self.cpu = cpu
        self._children = list(children)
        self.ignores_term = ignores_term
        self.created = created
        self.alive = True
        self.signals: List[str] = []

    def cmdline(self):
        if not self.alive:
            raise psutil.NoSuchProcess(self.pid)
        return self._cmdline

    def terminate(self):
        self.signals.append("TERM")
        if not self.ignores_term:
            self.alive = False

    def kill(self):
        self.signals.append("KILL")
        self.alive = False

    def resume(self):  # SIGCONT: nothing to do for a process that is not stopped
        if not self.alive:
            raise psutil.NoSuchProcess(self.pid)

    def cpu_times(self):
        if not self.alive:
            raise psutil.NoSuchProcess(self.pid)
        return CpuTimes(self.cpu * 0.75, self.cpu * 0.25)

    def create_time(self):
        return self.created

    def children(self, recursive=False):
        return [c for c in self._children if c.alive]


class FakeTable:
    def __init__(self, *procs):
        self.procs = list(procs)
        self.waits: List[float] = []

    def get(self, pid):
        return next((p for p in self.procs if p.pid == pid and p.alive), None)

    def all(self):
        return list(self.procs)

    def wait_gone(self, procs, timeout):
        self.waits.append(timeout)
        return [p for p in procs if p.alive]


# -- command actions: argv lists, exactly -------------------------------------


def test_launchd_kickstart_argv():
    runner = FakeRunner()
    result = LaunchdRestart("io.example.mlx", uid=501, runner=runner).restart("wedged")
    assert result.ok
    assert runner.calls == [(["launchctl", "kickstart", "-k", "gui/501/io.example.mlx"], 60.0)]


def test_launchd_default_uid_and_system_domain():
    assert LaunchdRestart("x").argv == ["launchctl", "kickstart", "-k", f"gui/{os.getuid()}/x"]
    assert LaunchdRestart("x", domain="system").argv == ["launchctl", "kickstart", "-k", "system/x"]


def test_systemd_argv():
    assert SystemdRestart("mlx.service").argv == ["systemctl", "--user", "--no-block",
                                                     "restart", "mlx.service"]
    assert SystemdRestart("mlx.service", user=False).argv == ["systemctl", "--no-block", "restart",
                                                                 "mlx.service"]


def test_command_argv_is_passed_untouched():
    runner = FakeRunner()
    argv = ["/usr/local/bin/restart me", "--why", "a; rm -rf /"]
    assert CommandRestart(argv, runner=runner, timeout=5).restart("r").ok
    assert runner.calls == [(argv, 5)]


@pytest.mark.parametrize("argv", ["restart-mlx --now", [], ["ok", 3]])
def test_command_argv_must_be_a_list_of_strings(argv):
    with pytest.raises(ValueError):
        CommandRestart(argv)


def test_non_zero_exit_is_reported_with_the_last_line_of_output():
    runner = FakeRunner(returncode=113, stderr="warming up\nCould not find service \"x\"\n")
    result = LaunchdRestart("x", uid=1, runner=runner).restart("r")
    assert not result.ok
    assert "exited with status 113" in result.detail
    assert 'Could not find service "x"' in result.detail


def test_missing_binary_is_reported():
    result = SystemdRestart("u", runner=FakeRunner(raises=FileNotFoundError())).restart("r")
    assert not result.ok and result.detail == "systemctl: command not found"


def test_timeout_and_other_os_errors_are_reported():
    timed_out = FakeRunner(raises=subprocess.TimeoutExpired(["x"], 5))
    result = CommandRestart(["x"], runner=timed_out, timeout=5).restart("r")
    assert not result.ok and "timed out after 5s" in result.detail
    denied = FakeRunner(raises=PermissionError(13, "Permission denied"))
    result = CommandRestart(["x"], runner=denied).restart("r")
    assert not result.ok and "Permission denied" in result.detail


def test_real_runner_with_a_real_missing_binary():
    result = CommandRestart(["/nonexistent/mlx-restart"]).restart("r")
    assert not result.ok and "command not found" in result.detail


def test_real_runner_with_a_failing_command(tmp_path):
    result = CommandRestart(["sh", "-c", "echo nope >&2; exit 3"]).restart("r")
    assert not result.ok and "status 3: nope" in result.detail


# -- signal action -------------------------------------------------------------


def test_signal_terminates_and_waits_the_grace():
    server = FakeProc(42)
    table = FakeTable(server)
    result = SignalRestart(pid=42, grace_s=7, table=table).restart("wedged")
    assert result.ok and "SIGTERM" in result.detail
    assert server.signals == ["TERM"] and table.waits == [7]


def test_signal_kills_after_the_grace():
    server = FakeProc(42, ignores_term=True)
    result = SignalRestart(pid=42, table=FakeTable(server)).restart("wedged")
    assert result.ok and "SIGKILLed" in result.detail
    assert server.signals == ["TERM", "KILL"]


def test_signal_no_such_pid():
    result = SignalRestart(pid=42, table=FakeTable()).restart("r")
    assert not result.ok and result.detail == "no process with pid 42"


def test_signal_by_pidfile(tmp_path):
    pidfile = tmp_path / "server.pid"
    pidfile.write_text("42\n")
    server = FakeProc(42)
    assert SignalRestart(pidfile=str(pidfile), table=FakeTable(server)).restart("r").ok
    assert server.signals == ["TERM"]


@pytest.mark.parametrize("content, expected", [(None, "cannot read pidfile"),
                                               ("garbage", "does not hold a pid")])
def test_signal_bad_pidfile(tmp_path, content, expected):
    pidfile = tmp_path / "server.pid"
    if content is not None:
        pidfile.write_text(content)
    result = SignalRestart(pidfile=str(pidfile), table=FakeTable()).restart("r")
    assert not result.ok and expected in result.detail


def test_signal_by_match_picks_the_one_process():
    server = FakeProc(42, ["python", "-m", "mlx_lm.server", "--port", "8080"])
    other = FakeProc(43, ["python", "-m", "mlx_lm.server", "--port", "9090"])
    table = FakeTable(server, other)
    assert SignalRestart(match=r"mlx_lm\.server.*--port 8080", table=table).restart("r").ok
    assert server.signals == ["TERM"] and other.signals == []


def test_signal_refuses_an_ambiguous_match():
    a = FakeProc(42, ["mlx_lm.server"])
    b = FakeProc(43, ["mlx_lm.server"])
    result = SignalRestart(match="mlx_lm.server", table=FakeTable(a, b)).restart("r")
    assert not result.ok and "2 processes match" in result.detail and "42, 43" in result.detail
    assert a.signals == b.signals == []


def test_signal_match_never_picks_the_watchdog_itself():
    me = FakeProc(os.getpid(), ["mlx-watchdog", "mlx_lm.server"])
    result = SignalRestart(match="mlx_lm.server", table=FakeTable(me)).restart("r")
    assert not result.ok and "no process matches" in result.detail


def test_signal_permission_denied():
    class Protected(FakeProc):
        def terminate(self):
            raise psutil.AccessDenied(self.pid)

    result = SignalRestart(pid=1, table=FakeTable(Protected(1))).restart("r")
    assert not result.ok and "not allowed" in result.detail


def test_signal_needs_exactly_one_way_to_find_the_process():
    with pytest.raises(ValueError):
        SignalRestart()
    with pytest.raises(ValueError):
        SignalRestart(pid=1, match="x")


# -- CPU sampling ----------------------------------------------------------------


def sampler_for(find, start: float = 1000.0) -> CpuSampler:
    """A sampler whose clocks advance 5 s per sample."""
    ticks = iter(range(10000))
    now = [start]

    def clock():
        now[0] = start + 5 * next(ticks)
        return now[0]

    return CpuSampler(find, clock=clock, wall_clock=lambda: now[0])


def test_cpu_sampler_reports_deltas_over_the_tree():
    worker = FakeProc(2, cpu=1.0, created=2.0)
    server = FakeProc(1, cpu=10.0, children=[worker])
    sampler = sampler_for(lambda: server)
    first = sampler.sample()
    assert first.alive and first.cpu_s is None  # nothing to compare yet
    server.cpu, worker.cpu = 11.0, 2.5
    second = sampler.sample()
    assert second.cpu_s == pytest.approx(2.5) and second.wall_s == 5.0
    worker.alive = False  # an exiting child must not make the total go backwards
    server.cpu = 11.5
    assert sampler.sample().cpu_s == pytest.approx(0.5)


def test_cpu_sampler_pid_reuse_starts_afresh():
    procs = [FakeProc(1, cpu=100.0, created=1.0), FakeProc(1, cpu=0.2, created=1004.0)]
    sampler = sampler_for(lambda: procs.pop(0))
    sampler.sample()
    assert sampler.sample().cpu_s == pytest.approx(0.2)


def test_cpu_sampler_process_not_found_is_not_alive():
    def find():
        raise ProcessNotFound("gone")

    assert CpuSampler(find).sample().alive is False


def test_cpu_sampler_access_denied_is_alive_without_cpu():
    class Hidden(FakeProc):
        def cpu_times(self):
            raise psutil.AccessDenied(self.pid)

    sample = CpuSampler(lambda: Hidden(1)).sample()
    assert sample.alive is True and sample.cpu_s is None


def test_cpu_sampler_on_this_very_process():
    sampler = CpuSampler(ProcessLocator(pid=os.getpid()).find)
    sampler.sample()
    sum(i * i for i in range(200000))
    sample = sampler.sample()
    assert sample.alive and sample.cpu_s is not None and sample.cpu_s >= 0


def test_cpu_sampler_lists_children_only_when_asked_or_the_root_changes():
    server = FakeProc(1, cpu=1.0)
    sampler = sampler_for(lambda: server)
    sampler.sample(rescan=False)  # t=1000
    server._children.append(FakeProc(2, cpu=3.0, created=1006.0))  # a worker appears
    assert sampler.sample(rescan=False).cpu_s == 0.0  # t=1005: not looked for
    assert sampler.sample(rescan=True).cpu_s == pytest.approx(3.0)  # t=1010, born 1006
    replacement = FakeProc(3, cpu=0.5, created=1012.0,
                           children=[FakeProc(4, cpu=1.0, created=1013.0)])
    server = replacement  # a new root: its children are listed at once
    sampler._find = lambda: server
    assert sampler.sample(rescan=False).cpu_s == pytest.approx(1.5)


def test_locator_caches_a_match_while_the_process_runs():
    class Counting(FakeTable):
        scans = 0

        def all(self):
            Counting.scans += 1
            return super().all()

    server = FakeProc(42, ["mlx_lm.server"])
    server.is_running = lambda: server.alive
    locator = ProcessLocator(match="mlx_lm", table=Counting(server))
    assert locator.find_cached() is server and locator.find_cached() is server
    assert Counting.scans == 1
    server.alive = False
    with pytest.raises(ProcessNotFound):
        locator.find_cached()
    assert Counting.scans == 2


def test_cpu_sampler_a_long_lived_child_found_late_counts_from_then():
    server = FakeProc(1, cpu=1.0, created=10.0)
    sampler = sampler_for(lambda: server)
    sampler.sample(rescan=False)
    server._children.append(FakeProc(2, cpu=500.0, created=20.0))  # old, just found
    assert sampler.sample(rescan=True).cpu_s == 0.0
    server._children[0].cpu = 502.0
    assert sampler.sample(rescan=True).cpu_s == pytest.approx(2.0)


FAKE_SYSTEMCTL = """#!/bin/sh
# A systemctl whose unit hit its start limit: restart is refused until reset-failed.
echo "$*" >> "$FAKE_SYSTEMCTL_LOG"
case "$*" in
  *reset-failed*) rm -f "$FAKE_SYSTEMCTL_STATE"; exit 0;;
  *restart*)
    if [ -e "$FAKE_SYSTEMCTL_STATE" ]; then
      echo "Job for mlx.service failed because the start of the service was attempted too often." >&2
      echo "See \\"systemctl status mlx.service\\" and \\"journalctl -xeu mlx.service\\" for details." >&2
      echo "To force a start use \\"systemctl reset-failed mlx.service\\" followed by \\"systemctl start mlx.service\\" again." >&2
      exit 1
    fi
    exit 0;;
esac
exit 0
"""  # noqa: E501 - systemctl's own words, verbatim


def test_systemd_restart_survives_a_unit_that_hit_its_start_limit(tmp_path, monkeypatch):
    (tmp_path / "systemctl").write_text(FAKE_SYSTEMCTL)
    (tmp_path / "systemctl").chmod(0o755)
    state, log = tmp_path / "start-limit-hit", tmp_path / "calls"
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SYSTEMCTL_STATE", str(state))
    monkeypatch.setenv("FAKE_SYSTEMCTL_LOG", str(log))
    action = SystemdRestart("mlx.service")
    for _ in range(3):  # failed by the start limit each time: restarts still happen
        state.touch()
        result = action.restart("wedged")
        assert result.ok, result.detail
    calls = log.read_text().splitlines()
    assert calls[:2] == ["--user reset-failed mlx.service", "--user --no-block restart mlx.service"]


class ScriptedRunner:
    def __init__(self, answers):
        self.answers, self.calls = list(answers), []

    def __call__(self, argv, timeout):
        self.calls.append(argv)
        code, err = self.answers.pop(0) if "restart" in argv else (0, "")
        return subprocess.CompletedProcess(argv, code, "", err)


def test_systemd_start_limit_refusal_is_answered_with_reset_failed_and_a_retry():
    refused = (1, "Job for mlx.service failed because the start of the service was "
                  "attempted too often.\nSee \"systemctl status mlx.service\"\n")
    runner = ScriptedRunner([refused, (0, "")])
    result = SystemdRestart("mlx.service", user=False, runner=runner).restart("r")
    assert result.ok and "start limit" in result.detail
    assert [c[1] for c in runner.calls] == ["reset-failed", "--no-block", "reset-failed",
                                            "--no-block"]
    runner = ScriptedRunner([refused, refused])
    result = SystemdRestart("mlx.service", user=False, runner=runner).restart("r")
    assert not result.ok and "start limit hit" in result.detail
