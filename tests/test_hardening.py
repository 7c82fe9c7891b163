"""Issue 9, the watchdog's side: config, probe, security and CLI hardening.

Unit tests with fakes (the watchdog's own logic) and harness/fakeserver.py.
Each test fails without its fix.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlx_watchdog import defaults, probe as probe_module
from mlx_watchdog.install import systemd
from mlx_watchdog.act import CommandRestart
from mlx_watchdog.cli import main
from mlx_watchdog.config import (
    ConfigError,
    InstanceConfig,
    RestartConfig,
    load_config,
    parse_config,
)
from mlx_watchdog.heartbeat import read_heartbeat
from mlx_watchdog.judge import BUSY, Judge
from mlx_watchdog.monitor import Monitor
from mlx_watchdog.policy import RestartPolicy
from mlx_watchdog.probe import Probe, ProbeResult, check_url
from mlx_watchdog.process import CpuSampler, ProcessLocator
from mlx_watchdog.redact import Secret, printable, scrub
from mlx_watchdog.state import StateStore, read_state
from mlx_watchdog.status_view import format_status
from mlx_watchdog.supervise import Supervisor, url_from_command
from harness.fakeserver import FakeServer, json_answer

REPO = Path(__file__).resolve().parents[1]


def run_cli(argv, **kwargs):
    return CliRunner().invoke(main, argv, catch_exceptions=False, **kwargs)


def instance(**extra):
    body = {"url": "http://127.0.0.1:8080", "restart": {"type": "none"}}
    body.update(extra)
    return {"instances": {"a": body}}


# -- 5: state and lock files in a folder another user owns --------------------------


def test_a_symlink_planted_as_the_lock_is_refused_and_its_target_not_created(tmp_path):
    state = tmp_path / "state.json"
    victim = tmp_path / "victim"
    os.symlink(victim, f"{state}.lock")
    store = StateStore(state)
    store.update("a", {"state": "healthy"})
    assert not victim.exists()
    assert "symbolic link" in store.error and "refusing" in store.error


def test_a_fifo_planted_as_the_lock_or_heartbeat_never_blocks(tmp_path):
    state = tmp_path / "state.json"
    os.mkfifo(f"{state}.lock")
    os.mkfifo(tmp_path / "heartbeat")
    os.mkfifo(tmp_path / "other.json")
    results = {}

    def attempt():
        store = StateStore(state)
        store.update("a", {"state": "healthy"})
        results["error"] = store.error
        results["beat"] = read_heartbeat(tmp_path / "heartbeat")
        try:
            read_state(tmp_path / "other.json")
        except OSError as exc:
            results["read"] = str(exc)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(30)  # a hang guard: without the fix this blocks forever
    assert not thread.is_alive(), "blocked on a FIFO"
    assert "FIFO" in results["error"]
    assert results["beat"] is None
    assert "FIFO" in results["read"]


def test_the_root_watchdog_keeps_its_state_in_a_root_owned_folder_of_its_own(tmp_path):
    from mlx_watchdog.install.backend import default_layout
    from mlx_watchdog.install.instance import Instance, watchdog_config_toml

    layout = default_layout("systemd", home=tmp_path, system=True)
    inst = Instance(
        manager="systemd", name="m", model="/m", host="127.0.0.1", port=8080,
        python="/usr/bin/python3", watchdog_python="/usr/bin/python3", shim_dir="/s",
        layout=layout, system=True, user_name="daemon",
    )
    watchdog = systemd.watchdog_unit(inst)
    server = systemd.server_unit(inst)
    assert "StateDirectory=mlx-watchdog-root\n" in watchdog
    assert "StateDirectory=mlx-watchdog\n" in server
    toml = watchdog_config_toml(inst, systemd.restart_action(inst))
    assert 'state_file = "/var/lib/mlx-watchdog-root/m.state.json"' in toml
    assert "/var/lib/mlx-watchdog/m.heartbeat" in toml  # the server's, read only


def test_watch_obeys_sigterm_taken_by_another_thread():
    # The signal lands on a monitor thread: without set_wakeup_fd the main
    # thread sleeps on in select() and the handler never runs.
    script = textwrap.dedent("""
        import signal, sys, threading
        from mlx_watchdog.watch import Watcher

        class Monitor:
            state = None
            events = None
            def started(self): pass
            ticks = 0
            def tick(self):
                self.ticks += 1
                if self.ticks == 10:  # the main thread is asleep in select by then
                    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

        sys.exit(Watcher({"a": Monitor()}, {"a": 0.05}).run())
    """)
    try:  # a hang guard: without the fix the main thread sleeps its hour
        proc = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True)
    except subprocess.TimeoutExpired:
        pytest.fail("SIGTERM taken by a monitor thread did not stop watch")
    assert proc.returncode == 0, proc.stderr


# -- 6: the API key ---------------------------------------------------------------------

KEY = "sk-Hardening\"Key\\42"


def test_a_key_with_a_trailing_newline_is_stripped_and_works():
    seen = []

    def completion(body):
        return json_answer(200, {"choices": [{"message": {"content": "x"}}]})

    with FakeServer(completion=completion) as fake:
        result = Probe(fake.url, api_key="sk-newline-key\n", timeout=5)()
        seen = [headers.get("Authorization") for _, headers, _ in fake.requests]
    assert result.ok, result.reason
    assert seen == ["Bearer sk-newline-key"]


def test_the_key_is_scrubbed_in_its_repr_and_json_forms_everywhere(tmp_path):
    Secret(KEY + "\n")
    for form in (KEY, repr(KEY), json.dumps(KEY), repr(KEY.encode())):
        assert KEY not in scrub(f"x {form} y") and "***" in scrub(f"x {form} y")
    store = StateStore(tmp_path / "state.json")
    store.update("a", {"state": "down", "reason": f"echo {KEY}", "detail": [repr(KEY)]})
    text = (tmp_path / "state.json").read_text()
    assert "Hardening" not in text, text
    assert "Hardening" not in format_status(read_state(tmp_path / "state.json"))


def test_a_restart_commands_argv_and_stderr_are_scrubbed():
    Secret(KEY)

    def runner(argv, timeout):
        return subprocess.CompletedProcess(argv, 3, "", f"bad token {KEY}\n")

    action = CommandRestart(["/bin/restart", f"--token={KEY}"], runner=runner)
    result = action.restart("wedged")
    assert not result.ok and "Hardening" not in result.detail and "***" in result.detail
    assert "Hardening" not in str(action) + repr(action)


def test_the_key_is_not_passed_to_the_server_child_and_help_warns_about_ps():
    supervisor = Supervisor(
        ["true"], InstanceConfig("a", "http://127.0.0.1:8080", RestartConfig("none")),
        probe=lambda: None, env={defaults.API_KEY_ENV: "k", "KEEP": "1"}
    )
    assert defaults.API_KEY_ENV not in supervisor.env and supervisor.env["KEEP"] == "1"
    for command in ("probe", "supervise"):
        assert "ps" in " ".join(run_cli([command, "--help"]).output.split())


def test_a_blank_api_key_env_is_a_config_error(monkeypatch):
    monkeypatch.setenv("BLANK_KEY", " \n")
    with pytest.raises(ConfigError, match="api_key_env.*empty"):
        parse_config(instance(api_key_env="BLANK_KEY"))


# -- 8: non-finite numbers -------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
def test_non_finite_flags_are_refused_naming_the_flag(value):
    result = run_cli(["supervise", "--probe-timeout", value, "--", "mlx_lm.server"])
    assert result.exit_code == 2 and "--probe-timeout" in result.output
    result = run_cli(["probe", "--timeout", value])
    assert result.exit_code == 2 and "--timeout" in result.output


@pytest.mark.parametrize("key", ["interval", "timeout", "boot_grace", "cpu_busy"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_config_values_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"instances\.a\.{key}: expected a finite"):
        parse_config(instance(**{key: value}))


# -- 9: the deadline covers name resolution ---------------------------------------------


def test_a_resolver_that_never_answers_is_bounded_by_the_timeout(monkeypatch):
    released = threading.Event()
    real = socket.getaddrinfo

    def never(host, *args, **kwargs):
        if host == "never.example" and not kwargs.get("flags"):
            released.wait(60)
            raise socket.gaierror("resolver gone")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", never)
    try:
        result = Probe("http://never.example:8080", timeout=0.3)()
    finally:
        released.set()
    assert result.status == "unhealthy" and "resolving never.example" in result.reason


def test_a_resolved_name_keeps_its_host_header(monkeypatch):
    real = socket.getaddrinfo

    def fake(host, port, *args, **kwargs):
        return real("127.0.0.1" if host == "model.example" else host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    with FakeServer() as server:
        result = Probe(f"http://model.example:{server.port}", timeout=5)()
        hosts = [headers.get("Host") for _, headers, _ in server.requests]
    assert result.ok, result.reason
    assert hosts == [f"model.example:{server.port}"]


# -- 10: the system trust store, SSL_CERT_FILE and --cacert ----------------------------


@pytest.fixture
def https_server(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    with FakeServer() as fake:
        fake._server.socket = context.wrap_socket(fake._server.socket, server_side=True)
        yield fake, cert


def test_https_honours_cacert_and_ssl_cert_file(https_server, monkeypatch):
    fake, cert = https_server
    url = f"https://127.0.0.1:{fake.port}"
    monkeypatch.setattr(probe_module, "_tls", {})
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    assert "TLS" in Probe(url, timeout=5)().reason  # not trusted by default
    assert Probe(url, timeout=5, cacert=str(cert))().ok
    monkeypatch.setattr(probe_module, "_tls", {})
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    assert Probe(url, timeout=5)().ok
    result = run_cli(["probe", "--url", url, "--cacert", str(cert)])
    assert json.loads(result.output)["status"] == "ok"


def test_a_bad_cacert_is_refused_up_front(tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    result = run_cli(["probe", "--cacert", str(bad)])
    assert result.exit_code == 2 and "--cacert" in result.output
    with pytest.raises(ConfigError, match="instances.a.cacert"):
        parse_config(instance(cacert=str(bad)))


# -- 11: an ambiguous process_match ----------------------------------------------------


class _Proc:
    def __init__(self, pid):
        self.pid = pid

    def cmdline(self):
        return ["mlx_lm.server", "--port", "8080"]


class _Table:
    def all(self):
        return [_Proc(101), _Proc(102)]


def test_two_matching_processes_are_ambiguous_not_down_and_never_restarted():
    locator = ProcessLocator(match="mlx_lm.server", table=_Table())
    sample = CpuSampler(locator.find_cached).sample()
    assert sample.alive is None and "ambiguous" in sample.problem and "101, 102" in sample.problem

    restarts = []

    class Action:
        def restart(self, reason):
            restarts.append(reason)

    failed = ProbeResult(status="unhealthy", latency_s=1.0, reason="timed out after 1s")
    monitor = Monitor(
        "a", lambda: failed, judge=Judge(), policy=RestartPolicy(boot_grace_s=0),
        action=Action(), process=CpuSampler(locator.find_cached),
    )
    verdicts = [monitor.tick() for _ in range(6)]
    assert restarts == []
    assert all(v.state == BUSY and "ambiguous" in v.reason for v in verdicts), verdicts


# -- 12: URLs and ports ---------------------------------------------------------------


@pytest.mark.parametrize(
    "url", ["htp://127.0.0.1:8080", "http://", "http://x:99999", "http://x:0", "127.0.0.1:8080",
            "http://a b:80"],
)
def test_bad_urls_are_refused_up_front(url):
    with pytest.raises(ValueError, match="invalid URL"):
        check_url(url)
    result = run_cli(["supervise", "--url", url, "--", "mlx_lm.server"])
    assert result.exit_code == 2 and "--url" in result.output
    with pytest.raises(ConfigError, match="instances.a.url"):
        parse_config(instance(url=url))


@pytest.mark.parametrize(
    "command",
    [["bash", "-c", "mlx_lm.server --port 9000"], ["./serve.sh"], ["mlx_lm.server", "--port"]],
)
def test_a_port_that_cannot_be_found_is_an_error(command):
    with pytest.raises(ValueError):
        url_from_command(command)
    result = run_cli(["supervise", "--", *command])
    assert result.exit_code == 2 and "pass --url" in result.output


@pytest.mark.parametrize("args", [["--port", "9999"], ["--host=0.0.0.0"], ["--model", "x"]])
def test_install_refuses_host_and_port_after_the_double_dash(tmp_path, args):
    result = run_cli(["install", "systemd", "--model", str(tmp_path), "--dry-run",
                      "--output-dir", str(tmp_path / "out"), "--", *args])
    assert result.exit_code == 2 and "after -- is not allowed" in result.output
    assert not (tmp_path / "out").exists()


# -- 13: install --python paths systemd cannot run -------------------------------------


@pytest.mark.parametrize("char", ['"', "'", "\\"])
def test_install_refuses_a_python_path_systemd_cannot_run(tmp_path, char):
    folder = tmp_path / f"py{char}env" / "bin"
    folder.mkdir(parents=True)
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    result = run_cli(["install", "systemd", "--model", str(tmp_path), "--dry-run",
                      "--output-dir", str(tmp_path / "out"), "--python", str(python)])
    assert result.exit_code == 2 and "systemd refuses" in result.output, result.output


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_a_dollar_in_the_executable_path_is_literal_and_verifies(tmp_path):
    folder = tmp_path / "py$HOME env" / "bin"
    folder.mkdir(parents=True)
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    line = systemd.exec_line([str(python), "-m", "x", "$HOME"])
    assert line == f'"{python}" -m x "$$HOME"'
    unit = tmp_path / "t.service"
    unit.write_text(f"[Service]\nExecStart={line}\n")
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "t.service" not in proc.stderr, proc.stderr


# -- 14: messages, not tracebacks; escaped control characters --------------------------


def test_a_newline_in_model_is_a_message(tmp_path):
    result = CliRunner().invoke(main, ["install", "systemd", "--model", "org/model\nX=1",
                                       "--dry-run", "--output-dir", str(tmp_path / "out")])
    assert result.exit_code == 2 and "control character" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_non_utf8_toml_is_a_config_error(tmp_path):
    path = tmp_path / "watch.toml"
    path.write_bytes(b'[instances.a]\nurl = "http://127.0.0.1:8080"\nmodel = "\xff"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)


@pytest.mark.parametrize(
    "record",
    [[1, 2], "text", {"state": "healthy", "last_probe": {"status": "x", "latency_s": "slow"}},
     {"since": "yesterday", "restarts": None, "last_restart": {"time": [1]}, "daemon_pid": -4}],
)
def test_status_shows_a_malformed_record_without_a_traceback(tmp_path, record):
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"version": 1, "instances": {"bad": record}}))
    result = run_cli(["status", "--state-file", str(path)])
    # Shown, and not called healthy: `status` exits 1 as for any instance not serving.
    healthy = isinstance(record, dict) and record.get("state") == "healthy"
    assert result.exit_code == (0 if healthy else 1), result.output
    assert result.output.startswith("INSTANCE") and "\nbad " in result.output
    assert not isinstance(result.exception, Exception), result.exception


def test_a_taken_metrics_port_names_the_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(["supervise", "--metrics-port", str(port), "--", "mlx_lm.server"])
    assert result.exit_code == 1 and f"127.0.0.1:{port}" in result.output
    assert "None" not in result.output


def test_terminal_escapes_from_a_server_are_escaped_in_the_reason_and_status(tmp_path):
    evil = "\x1b]0;owned\x07\x1b[2J boom \x9b31m"
    with FakeServer(completion=json_answer(500, {"error": evil})) as fake:
        result = Probe(fake.url, timeout=5)()
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in result.reason)
    assert "\\x1b]0;owned" in result.reason
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"version": 1, "instances": {"a": {"state": "down", "reason": evil}}}))
    shown = format_status(read_state(path), pid_alive=lambda pid: True)
    assert "\x1b" not in shown and "\\x1b" in shown
    assert printable("a\nb") == "a\\x0ab"
