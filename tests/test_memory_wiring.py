"""The memory guard wired in: the watch keys and supervise/install flags, the
monitor's soft line (the request file, the metric, the state), the planned
restart with cause memory and its report, reboot required, the probe that
is not fooled by the soft line's 503, and `status`. Fakes for our own logic
only; the real server is tests/test_memory_real.py."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from harness.fakes import Clock, FakeProcess
from mlx_watchdog import compose, reports
from mlx_watchdog.cli import main
from mlx_watchdog.config import ConfigError, InstanceConfig, RestartConfig, parse_config
from mlx_watchdog.judge import Judge, JudgeConfig
from mlx_watchdog.memory import GiB, Machine, MiB, request_path
from mlx_watchdog.memory_guard import Readers
from mlx_watchdog.metrics import Metrics
from mlx_watchdog.monitor import Monitor
from mlx_watchdog.policy import RestartPolicy
from mlx_watchdog.probe import OK, ProbeResult
from mlx_watchdog.state import StateStore, read_state
from mlx_watchdog.status_view import format_status
from tests.test_monitor import logs  # noqa: F401 - a fixture
from tests.test_restart import PlannedAction

GOOD = ProbeResult(OK, 0.2, tokens=1, reason="ok", http_status=200)
PID = 4242


# -- the keys and flags --------------------------------------------------------------------


def _instance(**keys):
    body = {"url": "http://127.0.0.1:8080", "restart": {"type": "none"}, **keys}
    return parse_config({"instances": {"gemma": body}}, "watch.toml").instances[0]


def test_the_watch_keys_and_their_defaults():
    plain = _instance()
    assert (plain.memory_limit, plain.memory_horizon, plain.memory_idle_wait) == (
        "auto", 6 * 3600, 300)
    given = _instance(memory_limit="48G", memory_horizon="30m", memory_idle_wait=90)
    assert (given.memory_limit, given.memory_horizon, given.memory_idle_wait) == (
        "48G", 1800, 90)
    assert _instance(memory_limit="80%").memory_limit == "80%"


@pytest.mark.parametrize("key, value, says", [
    ("memory_limit", "48X", "instances.gemma.memory_limit: expected bytes with a unit (48G, "
                            "512M, 1.5T), a share of RAM (80%), auto or off (memory limit "
                            "'48X': unknown unit 'X'"),
    ("memory_limit", 48, "did you mean 48G?"),
    ("memory_limit", True, "instances.gemma.memory_limit: expected bytes with a unit"),
    ("memory_horizon", "soon", "instances.gemma.memory_horizon: expected a positive number "
                               "of seconds or a duration such as \"90s\", \"30m\", \"6h\""),
    ("memory_idle_wait", -5, "instances.gemma.memory_idle_wait: expected a positive"),
    ("memory_limt", "48G", 'unknown key (did you mean "memory_limit"?)'),
])
def test_bad_watch_keys_name_the_key_and_the_fix(key, value, says):
    with pytest.raises(ConfigError) as caught:
        _instance(**{key: value})
    assert says in str(caught.value)


@pytest.mark.parametrize("flag, value, says", [
    ("--memory-limit", "48X", "memory limit '48X': unknown unit 'X'"),
    ("--memory-limit", "150%", "a share of RAM must be above 0% and at most 100%"),
    ("--memory-horizon", "soon", "--memory-horizon 'soon': expected seconds or a duration"),
    ("--memory-idle-wait", "0", "--memory-idle-wait '0': must be a positive duration"),
])
def test_bad_supervise_flags_name_the_fix(flag, value, says):
    result = CliRunner().invoke(main, ["supervise", flag, value, "--", "true"])
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split())


def test_install_writes_the_memory_keys_into_the_watch_config(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    result = CliRunner().invoke(main, [
        "install", "systemd", "--model", str(model), "--port", "18123", "--dry-run",
        "--output-dir", str(tmp_path / "out"), "--memory-limit", "48G",
        "--memory-horizon", "2h", "--memory-idle-wait", "90s"])
    assert result.exit_code == 0, result.output
    [config] = list((tmp_path / "out").rglob("*.toml"))
    text = config.read_text()
    assert 'memory_limit = "48G"' in text and "memory_horizon = 7200.0" in text
    assert "memory_idle_wait = 90.0" in text
    from mlx_watchdog.config import load_config

    instance = load_config(config).instances[0]
    assert (instance.memory_limit, instance.memory_horizon, instance.memory_idle_wait) == (
        "48G", 7200.0, 90.0)
    bad = CliRunner().invoke(main, [
        "install", "systemd", "--model", str(model), "--dry-run",
        "--output-dir", str(tmp_path / "out2"), "--memory-limit", "lots"])
    assert bad.exit_code == 2 and "memory limit 'lots': not a size" in bad.output


# -- the monitor ----------------------------------------------------------------------------


class Server:
    """The heartbeat file a shimmed server would write, and the readers'
    numbers: what the test says the server holds."""

    def __init__(self, tmp_path):
        self.heartbeat = tmp_path / "server.heartbeat"
        self.pid = PID
        self.rss = 1 * GiB
        self.in_flight = 1
        self.wired = None  # the machine's wired memory (macOS only)
        self.footprint = None

    def beat(self):
        self.heartbeat.write_text(json.dumps({
            "pid": self.pid, "beats": 1, "time": 1.0, "phase": "serving",
            "in_flight": self.in_flight,
            "memory": {"rss": self.rss, "mlx_active": self.rss // 2}}))

    def readers(self):
        return Readers(footprint=lambda pid: self.footprint,
                       tree_rss=lambda pid: self.rss if pid == self.pid else None,
                       wired=lambda: self.wired)


def guarded_monitor(tmp_path, server, *, limit="10G", idle_wait=60, horizon=3600,
                    system="linux", action=None, metrics=None, supervised=True):
    clock = Clock()
    instance = InstanceConfig(
        name="gemma", url="http://127.0.0.1:8080", restart=RestartConfig("none"),
        heartbeat_file=str(server.heartbeat), report_dir=str(tmp_path / "reports"),
        memory_limit=limit, memory_horizon=horizon, memory_idle_wait=idle_wait, interval=5)
    from mlx_watchdog.log import Events

    events = Events("gemma")
    metrics = metrics or Metrics()
    guard = compose.memory_guard(
        instance, events=events, metrics=metrics,
        owner=(lambda: server.pid) if supervised else None, clock=clock,
        wall_clock=clock, machine=lambda: Machine(system, ram_bytes=64 * GiB),
        readers=server.readers())

    def probe():
        clock.now += 5
        server.beat()
        return GOOD

    return Monitor("gemma", probe, judge=Judge(JudgeConfig()),
                   policy=RestartPolicy(boot_grace_s=0, backoff_initial_s=0),
                   action=action if action is not None else PlannedAction(),
                   heartbeat_file=str(server.heartbeat), process=FakeProcess(),
                   events=events, metrics=metrics, state=StateStore(tmp_path / "state.json"),
                   clock=clock, wall_clock=clock, memory_guard=guard)


def _scrape(metrics):
    return metrics.render().decode()


def test_no_limit_no_guard_and_the_default_says_nothing(tmp_path, logs):
    server = Server(tmp_path)
    assert guarded_monitor(tmp_path, server, limit="auto").memory_guard is None
    assert guarded_monitor(tmp_path, server, limit="off").memory_guard is None
    assert not [e for e in logs() if e["event"] == "memory"]  # the default, off here
    mac = guarded_monitor(tmp_path, server, limit="auto", system="darwin")
    assert mac.memory_guard.config.limit_bytes == 56 * GiB  # 64 GiB RAM minus 8


def test_the_soft_line_asks_for_a_trim_and_a_503_then_lets_go(tmp_path, logs):
    server = Server(tmp_path)
    action, metrics = PlannedAction(), Metrics()
    monitor = guarded_monitor(tmp_path, server, action=action, metrics=metrics)
    monitor.started()
    monitor.tick()
    assert not (tmp_path / "server.heartbeat.memory").exists()
    scrape = _scrape(metrics)
    assert 'mlx_watchdog_memory_bytes{instance="gemma",kind="measure"} 1.073741824e+09' in scrape
    assert 'mlx_watchdog_memory_limit_bytes{instance="gemma"} 1.073741824e+10' in scrape
    assert 'mlx_watchdog_memory_soft{instance="gemma"} 0.0' in scrape

    server.rss = int(8.8 * GiB)  # 88% of 10G: over the soft line
    monitor.tick()
    request = json.loads(open(request_path(server.heartbeat)).read())
    assert request["pid"] == PID and request["trim"] == 1
    assert request["soft_until"] > monitor.clock()
    assert 'mlx_watchdog_memory_soft{instance="gemma"} 1.0' in _scrape(metrics)
    monitor.tick()  # still over: the hold renewed, no second trim yet
    assert json.loads(open(request_path(server.heartbeat)).read())["trim"] == 1
    soft = [e for e in logs() if e["event"] == "memory_soft"]
    assert len(soft) == 1 and "asked the server to trim" in soft[0]["message"]
    monitor.state.flush()
    record = read_state(monitor.state.path)["instances"]["gemma"]
    assert record["memory"]["state"] == "memory_soft"
    assert record["memory"]["bytes"] == int(8.8 * GiB)
    assert "88%" in format_status(read_state(monitor.state.path), now=monitor.clock())

    server.rss = 5 * GiB
    monitor.tick()
    request = json.loads(open(request_path(server.heartbeat)).read())
    assert "soft_until" not in request  # /health serves again now
    assert 'mlx_watchdog_memory_soft{instance="gemma"} 0.0' in _scrape(metrics)
    assert [e for e in logs() if "back under the soft line" in e["message"]]
    assert action.planned == [] and action.reasons == []


def test_the_hard_line_takes_a_drained_restart_with_a_memory_report(tmp_path, logs):
    server = Server(tmp_path)
    action, metrics = PlannedAction(), Metrics()
    monitor = guarded_monitor(tmp_path, server, action=action, metrics=metrics, idle_wait=60)
    monitor.started()
    for size in (2, 4, 6):
        server.rss = size * GiB
        monitor.tick()
    server.rss = int(9.6 * GiB)  # 96%: over the hard line, a request in flight
    monitor.tick()
    assert action.planned == []  # it waits for a moment with nothing in flight
    server.in_flight = 0
    monitor.tick()
    assert len(action.planned) == 1 and "over the hard line" in action.planned[0]
    assert "nothing in flight" in action.planned[0]
    assert action.reasons == []  # not a wedge restart: no stacks, no backoff
    scrape = _scrape(metrics)
    assert 'mlx_watchdog_restarts_total{cause="none",instance="gemma",reason="memory"} 1.0' in scrape
    monitor.state.flush()
    record = read_state(monitor.state.path)["instances"]["gemma"]
    assert record["last_restart"]["cause"] == "memory"
    assert record["memory"]["restarts"] == 1
    [report] = reports.load_reports(tmp_path / "reports")
    assert report["kind"] == "memory" and report["cause"] == "memory"
    assert report["trigger"] == "hard" and report["limit_bytes"] == 10 * GiB
    assert [s["bytes"] for s in report["samples"]] == [
        2 * GiB, 4 * GiB, 6 * GiB, int(9.6 * GiB), int(9.6 * GiB)]
    assert report["instance"]["name"] == "gemma"
    assert "memory" in reports.format_table(reports.load_reports(tmp_path / "reports"))
    # The new server starts afresh: its samples, its request file.
    assert monitor.memory_guard.samples() == []
    assert not (tmp_path / "server.heartbeat.memory").exists()


def test_the_hard_line_waits_at_most_the_idle_wait(tmp_path):
    server = Server(tmp_path)
    action = PlannedAction()
    monitor = guarded_monitor(tmp_path, server, action=action, idle_wait=12)
    monitor.started()
    server.rss = int(9.6 * GiB)
    server.in_flight = 3
    for _ in range(3):  # 5 s a tick
        monitor.tick()
    assert action.planned == []
    monitor.tick()
    assert len(action.planned) == 1 and "no idle moment in 12s" in action.planned[0]


def test_the_trend_restarts_before_the_hard_line(tmp_path):
    server = Server(tmp_path)
    action = PlannedAction()
    monitor = guarded_monitor(tmp_path, server, action=action, horizon=600)
    monitor.started()
    server.in_flight = 0
    server.rss = 2 * GiB
    for _ in range(40):  # 20 MiB a tick of 5 s: the hard line in about an hour
        server.rss += 20 * MiB
        monitor.tick()
    assert action.planned == []  # an hour away is beyond a 10 min horizon
    for _ in range(60):
        server.rss += 200 * MiB  # now it runs: the hard line within minutes
        monitor.tick()
        if action.planned:
            break
    assert len(action.planned) == 1 and "within the 0.166667 h horizon" in action.planned[0]
    assert server.rss < 0.95 * 10 * GiB  # before the line itself
    [report] = reports.load_reports(tmp_path / "reports")
    assert report["trigger"] == "trend" and report["eta_s"] <= 600


def test_the_soft_503_does_not_fail_the_watchdogs_own_probe():
    from harness.fakeserver import FakeServer, json_answer
    from mlx_watchdog.probe import Probe

    with FakeServer(health=json_answer(503, {"status": "memory", "in_flight": 0})) as server:
        probe = Probe(server.url, check_health=True, timeout=10)
        assert probe().ok  # the soft line: the server serves
        server.health = json_answer(503, {"status": "loading"})
        result = probe()
        assert not result.ok and result.dead_thread  # any other 503, as before


def test_reboot_required_holds_restarts_until_the_wired_memory_comes_back(tmp_path, logs):
    server = Server(tmp_path)
    server.wired = 40 * GiB
    server.footprint = {"phys_footprint": 9 * GiB, "wired_size": 30 * GiB}
    action, metrics = PlannedAction(), Metrics()
    monitor = guarded_monitor(tmp_path, server, action=action, metrics=metrics,
                              limit="50G", system="darwin")
    monitor.started()
    monitor.tick()
    assert monitor.memory_guard.config.limit_bytes == 50 * GiB
    assert monitor.planned_restart("operator").ok
    # The old server is gone, but the machine's wired memory stays up.
    for _ in range(13):  # 65 s
        monitor.tick()
    guard = monitor.memory_guard
    assert guard.hold_restarts and "reboot required" in guard.hold_restarts
    assert 'mlx_watchdog_reboot_required{instance="gemma"} 1.0' in _scrape(metrics)
    assert [e for e in logs() if e["event"] == "reboot-required" and e["level"] == "error"]
    from mlx_watchdog.judge import Verdict, WEDGED

    held = monitor.restart(Verdict(WEDGED, "hung", True, "heartbeat-stale"))
    assert not held.restart and "restarts held: reboot required" in held.reason
    assert action.reasons == []
    monitor.state.flush()
    record = read_state(monitor.state.path)["instances"]["gemma"]
    assert "REBOOT REQUIRED" in format_status(read_state(monitor.state.path),
                                              now=monitor.clock())
    assert record["memory"]["reboot_required"]
    server.wired = 8 * GiB  # it came back after all
    monitor.tick()
    assert guard.hold_restarts is None
    assert 'mlx_watchdog_reboot_required{instance="gemma"} 0.0' in _scrape(metrics)


def test_status_shows_memory_against_the_limit_only_where_guarded():
    now = 1000.0
    data = {"instances": {
        "a": {"state": "healthy", "since": now, "memory": {
            "bytes": 6 * GiB, "limit_bytes": 10 * GiB, "state": "ok"}},
        "b": {"state": "healthy", "since": now, "memory": None}}}
    text = format_status(data, now=now)
    assert "MEMORY" in text.splitlines()[0]
    assert "6.0G/10.0G 60%" in text
    plain = format_status({"instances": {"b": data["instances"]["b"]}}, now=now)
    assert "MEMORY" not in plain


# -- jetsam: a SIGKILL death without a report of its own (macOS) -----------------------------


def test_a_sigkilled_child_named_in_a_jetsam_report_gets_a_report_with_cause_jetsam(tmp_path):
    import signal
    from pathlib import Path

    from mlx_watchdog import macos
    from mlx_watchdog.supervise import Supervisor
    from tests.test_supervise import FakeSpawner, Probes

    jetsam_file = Path(__file__).parent / "data" / "macos" / "JetsamEvent-2026-05-15-220357.ips"
    looked_up = []

    def find_jetsam(pid, since=None):
        looked_up.append(pid)
        # The recorded report names pid 41733; the test's child stands for it.
        kill = macos.jetsam_kill_in(jetsam_file.read_text(), 41733, str(jetsam_file))
        return kill if pid == 1000 else None

    clock = Clock(100.0)
    spawner = FakeSpawner()
    supervisor = Supervisor(
        ["mlx_lm.server", "--port", "8080"],
        InstanceConfig("test", "http://127.0.0.1:8080", RestartConfig("none"),
                       report_dir=str(tmp_path / "reports")),
        probe=Probes(clock), env={"PATH": "/usr/bin"}, heartbeat_file=tmp_path / "hb.json",
        policy=RestartPolicy(boot_grace_s=0, backoff_initial_s=0), spawn=spawner,
        process=FakeProcess(), metrics=Metrics(), clock=clock, wall_clock=clock,
        jetsam=find_jetsam)
    supervisor.start()
    supervisor.tick()
    spawner.current.code = -signal.SIGKILL
    supervisor.tick()  # reaped, looked up, restarted
    assert looked_up == [1000]
    [report] = reports.load_reports(tmp_path / "reports")
    assert report["cause"] == "jetsam" and report["kind"] == "killed"
    assert report["jetsam"]["reason"] == "vm-compressor-space-shortage"
    assert report["jetsam"]["largest_process"] == "python3.12"
    assert "killed by jetsam (vm-compressor-space-shortage)" in report["reason"]
    assert len(spawner.children) == 2  # restarted as for any exit
    # Another way to die (not SIGKILL) is not looked up.
    spawner.current.code = 1
    supervisor.tick()
    assert looked_up == [1000]


def test_jetsam_is_looked_up_only_on_macos():
    from mlx_watchdog.supervise import Supervisor

    supervisor = Supervisor(["true"], InstanceConfig("t", "http://127.0.0.1:8080",
                                                     RestartConfig("none")),
                            env={}, probe=lambda: GOOD, listener_check=False)
    assert supervisor._jetsam is None  # Linux here


# -- keep the Mac awake: caffeinate -i -s -w <server pid> from the watchdog ------------------


class Spawned:
    def __init__(self, argv):
        self.argv = list(argv)
        self.code = None

    def poll(self):
        return self.code


def test_keep_awake_watches_each_server_pid_once_on_macos(logs):
    from mlx_watchdog.keep_awake import KeepAwake
    from mlx_watchdog.log import Events

    spawned = []

    def spawn(argv):
        spawned.append(Spawned(argv))
        return spawned[-1]

    awake = KeepAwake(Events("gemma"), spawn=spawn, platform="darwin")
    awake.observe(None)
    awake.observe(4242)
    awake.observe(4242)
    assert [p.argv for p in spawned] == [["/usr/bin/caffeinate", "-i", "-s", "-w", "4242"]]
    spawned[0].code = 0  # the server ended, and caffeinate with it
    awake.observe(4242)  # the heartbeat still names it: no respawn loop
    awake.observe(4343)  # the next server
    assert [p.argv[-1] for p in spawned] == ["4242", "4343"]

    def broken(argv):
        raise FileNotFoundError(2, "No such file or directory")

    failing = KeepAwake(Events("gemma"), spawn=broken, platform="darwin")
    failing.observe(1)
    failing.observe(1)
    said = [e for e in logs() if e["event"] == "keep-awake" and e["level"] == "warning"]
    assert len(said) == 1 and "the Mac may sleep" in said[0]["message"]
    linux = KeepAwake(Events("gemma"), spawn=spawn, platform="linux")
    linux.observe(5000)
    assert len(spawned) == 2


def test_the_monitor_keeps_the_current_server_awake(tmp_path):
    from mlx_watchdog.keep_awake import KeepAwake
    from mlx_watchdog.log import Events

    server = Server(tmp_path)
    spawned = []
    monitor = guarded_monitor(tmp_path, server, limit="off")
    monitor.keep_awake = KeepAwake(Events("gemma"), spawn=lambda a: spawned.append(a) or
                                   Spawned(a), platform="darwin")
    monitor.started()
    monitor.tick()
    assert spawned == [["/usr/bin/caffeinate", "-i", "-s", "-w", str(PID)]]
    assert _instance(caffeinate=True).caffeinate and not _instance().caffeinate


def test_install_launchd_keeps_awake_unless_allow_sleep(tmp_path):
    import tomllib

    model = tmp_path / "model"
    model.mkdir()

    def config(*flags, manager="launchd"):
        out = tmp_path / f"out{len(flags)}{manager}"
        result = CliRunner().invoke(main, [
            "install", manager, "--model", str(model), "--port", "18124", "--dry-run",
            "--output-dir", str(out), *flags])
        assert result.exit_code == 0, result.output
        [path] = list(out.rglob("*.toml"))
        return tomllib.loads(path.read_text())["instances"]["mlx-18124"]

    assert config()["caffeinate"] is True
    assert "caffeinate" not in config("--allow-sleep")
    assert "caffeinate" not in config(manager="systemd")
    bad = CliRunner().invoke(main, ["install", "systemd", "--model", str(model), "--dry-run",
                                    "--output-dir", str(tmp_path / "x"), "--allow-sleep"])
    assert bad.exit_code == 2 and "is for launchd only" in bad.output


# -- doctor: pmset and the sum of wired limits (macOS, from recorded outputs) ------------------


def _mac_runner(pmset_file, *, memsize=64 * GiB, wired_mb="0"):
    from pathlib import Path

    data = Path(__file__).parent / "data" / "macos"

    def runner(argv):
        if argv[0].endswith("pmset"):
            return (data / pmset_file).read_text()
        if argv[-1] == "hw.memsize":
            return f"{memsize}\n"
        if argv[-1] == "iogpu.wired_limit_mb":
            return f"{wired_mb}\n"
        return None

    return runner


def _doctor_checks(pmset_file, servers, **machine):
    from mlx_watchdog.doctor import Group, mac_memory_checks

    group = Group("Sleep and memory (macOS)")
    mac_memory_checks(group, runner=_mac_runner(pmset_file, **machine), platform="darwin",
                      servers=lambda: servers)
    return [(c.status, c.message, c.fix) for c in group.checks]


def test_doctor_names_the_pmset_sleep_of_a_laptop_and_its_fix():
    checks = _doctor_checks("pmset-g-laptop.txt", 0, wired_mb="49152")
    (status, message, fix), wired = checks
    assert status == "warn" and message.startswith("pmset: sleep 1: the Mac sleeps after 1")
    assert "caffeinate -i -s -w" in fix and "sudo pmset -a sleep 0" in fix
    assert wired[0] == "ok" and "0 mlx_lm server(s) running, and this one" in wired[1]


def test_doctor_passes_a_mac_that_never_sleeps():
    checks = _doctor_checks("pmset-g-disablesleep.txt", 0, wired_mb="49152")
    assert checks[0][0] == "ok" and "does not sleep" in checks[0][1]


def test_doctor_warns_when_the_servers_wired_limits_add_up_past_the_ram():
    # Six servers each allowed to wire 48 GiB of a 64 GiB Mac (mlx-lm PR #1252).
    *_, (status, message, fix) = _doctor_checks("pmset-g-disablesleep.txt", 5, wired_mb="49152")
    assert status == "warn"
    assert "5 mlx_lm server(s) running, and this one: each may wire up to 48.0G, 288.0G in " \
           "all, against 64.0G of RAM" in message
    assert "PR #1252" in message and "--memory-limit" in fix
    *_, (status, _, _) = _doctor_checks("pmset-g-disablesleep.txt", 0, wired_mb="49152")
    assert status == "ok"  # one server alone may wire its cap


def test_doctor_has_no_macos_group_on_linux():
    from mlx_watchdog.doctor import Context, memory_group

    assert memory_group(Context(None, "", "127.0.0.1", 8080, None, {})) is None


def test_a_memory_kind_no_longer_measured_leaves_the_scrape():
    metrics = Metrics()
    metrics.memory("gemma", {"measure": 5, "rss": 5, "mlx_active": 3}, soft=False)
    metrics.memory("gemma", {"measure": 6, "rss": 6}, soft=False)
    scrape = _scrape(metrics)
    assert 'kind="rss"} 6.0' in scrape and 'kind="mlx_active"' not in scrape


def test_watched_the_server_is_found_through_its_heartbeat(tmp_path):
    """`watch` has no child: the heartbeat's pid is the server's."""
    server = Server(tmp_path)
    monitor = guarded_monitor(tmp_path, server, supervised=False)
    monitor.started()
    server.rss = int(8.8 * GiB)
    monitor.tick()
    assert json.loads(open(request_path(server.heartbeat)).read())["pid"] == PID
    monitor.state.flush()
    memory = read_state(monitor.state.path)["instances"]["gemma"]["memory"]
    assert memory["parts"]["tree_rss"] == int(8.8 * GiB)
    assert memory["parts"]["mlx_active"] == int(8.8 * GiB) // 2
    assert memory["source"] == "RSS of the process tree"


class WiredAtRestart(PlannedAction):
    """A restart whose old server frees its wired memory, and whose new one
    wires the same again before the next tick (a quick model load)."""

    def __init__(self, server):
        super().__init__()
        self.server = server

    def restart_planned(self, reason):
        self.server.wired = 10 * GiB  # the old one is gone, the new one still imports
        return super().restart_planned(reason)


def test_wired_memory_freed_at_the_restart_is_seen_before_the_new_server_wires_it(tmp_path):
    server = Server(tmp_path)
    server.wired = 40 * GiB
    server.footprint = {"phys_footprint": 9 * GiB, "wired_size": 30 * GiB}
    action = WiredAtRestart(server)
    monitor = guarded_monitor(tmp_path, server, action=action, limit="50G", system="darwin")
    monitor.started()
    monitor.tick()
    assert monitor.planned_restart("operator").ok
    server.wired = 40 * GiB  # the new server loaded its model
    for _ in range(13):
        monitor.tick()
    assert monitor.memory_guard.hold_restarts is None
    assert monitor.memory_guard.wired.observe(monitor.clock(), None).state == "released"


class Exits(FakeProcess):
    def __init__(self):
        super().__init__()
        self.how = None

    def exited(self):
        return self.how


def test_held_restarts_resume_once_the_wired_memory_comes_back(tmp_path):
    server = Server(tmp_path)
    server.wired = 40 * GiB
    server.footprint = {"phys_footprint": 9 * GiB, "wired_size": 30 * GiB}
    action = PlannedAction()
    monitor = guarded_monitor(tmp_path, server, action=action, limit="50G", system="darwin")
    monitor.process = process = Exits()
    monitor.started()
    monitor.tick()
    assert monitor.planned_restart("operator").ok
    for _ in range(13):
        monitor.tick()
    assert monitor.memory_guard.hold_restarts
    process.how = "was killed by SIGKILL"  # the new server died: nothing to probe
    for _ in range(3):
        monitor.clock.now += 5
        verdict = monitor.tick()
        assert "restarts held: reboot required" in verdict.reason
    assert action.reasons == []
    server.wired = 8 * GiB  # it came back after all
    monitor.clock.now += 5
    monitor.tick()
    assert action.reasons and monitor.memory_guard.hold_restarts is None
