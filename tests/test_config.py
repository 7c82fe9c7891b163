"""config.load_config: a good file, and every kind of mistake."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlx_watchdog import defaults
from mlx_watchdog.cli import main
from mlx_watchdog.config import ConfigError, load_config
from mlx_watchdog.watch import build_action, build_locator

REPO = Path(__file__).resolve().parents[1]

GOOD = """
state_file = "~/mlx-state.json"
metrics_port = 9464
log_format = "json"

[instances.gemma]
url = "http://127.0.0.1:8080/"
model = "mlx-community/gemma"
api_key = "sk-secret-1"
interval = 2
timeout = 4.5
failures = 5
boot_grace = 0
heartbeat_file = "/tmp/gemma.heartbeat"
pidfile = "/tmp/gemma.pid"
max_busy = 0
restart = { type = "launchd", label = "io.example.gemma", uid = 501 }

[instances.qwen]
url = "http://127.0.0.1:8081"
restart = { type = "systemd", unit = "qwen.service", user = false }

[instances.llama]
url = "http://127.0.0.1:8082"
restart = { type = "signal", match = "mlx_lm.server .*--port 8082", grace = 3 }

[instances.phi]
url = "https://models.example:8443"
restart = { type = "command", argv = ["/usr/local/bin/restart-phi", "--hard"] }

[instances.watched-only]
url = "http://127.0.0.1:8084"
restart = { type = "none" }
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "watch.toml"
    path.write_text(text)
    return path


def error_for(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: "), message  # always names the file
    return message


def minimal(instance: str = "", restart: str = 'type = "none"', top: str = "") -> str:
    return (
        f"{top}\n[instances.a]\nurl = \"http://127.0.0.1:8080\"\n{instance}\n"
        f"[instances.a.restart]\n{restart}\n"
    )


def test_a_good_config(tmp_path):
    config = load_config(write(tmp_path, GOOD))
    assert config.metrics_port == 9464 and config.log_format == "json"
    assert config.state_file == str(Path("~/mlx-state.json").expanduser())
    by_name = {i.name: i for i in config.instances}
    assert list(by_name) == ["gemma", "qwen", "llama", "phi", "watched-only"]
    gemma = by_name["gemma"]
    assert gemma.url == "http://127.0.0.1:8080"
    assert (gemma.interval, gemma.timeout, gemma.failures, gemma.boot_grace) == (2, 4.5, 5, 0)
    assert gemma.api_key.reveal() == "sk-secret-1"
    qwen = by_name["qwen"]
    assert qwen.model == defaults.MODEL and qwen.interval == defaults.PROBE_INTERVAL_S
    assert build_action(gemma.restart).argv == [
        "launchctl", "kickstart", "-k", "gui/501/io.example.gemma"
    ]
    assert build_action(qwen.restart).argv == ["systemctl", "--no-block", "restart", "qwen.service"]
    assert build_action(by_name["phi"].restart).argv == ["/usr/local/bin/restart-phi", "--hard"]
    assert build_action(by_name["llama"].restart).grace_s == 3
    assert build_action(by_name["watched-only"].restart) is None
    # CPU evidence: the pidfile, or the process a signal restart would hit.
    assert build_locator(gemma).pidfile == "/tmp/gemma.pid"
    assert build_locator(by_name["llama"]).match == "mlx_lm.server .*--port 8082"
    assert build_locator(qwen) is None


@pytest.mark.parametrize("path", sorted(REPO.glob("*/mlx-*.toml")), ids=lambda p: p.parent.name)
def test_the_installers_reference_configs_are_valid(path):
    assert load_config(path).instances


def test_toml_syntax_error_names_file_and_line(tmp_path):
    message = error_for(tmp_path, "[instances.a\nurl = 1\n")
    assert "TOML syntax error" in message and "line 1" in message


def test_duplicate_instance_name(tmp_path):
    text = minimal() + '\n[instances.a]\nurl = "http://127.0.0.1:9"\n'
    message = error_for(tmp_path, text)
    assert "instances.a: duplicate instance name" in message and "line" in message


def test_unknown_key_suggests_the_right_one(tmp_path):
    message = error_for(tmp_path, minimal("intervall = 5"))
    assert "instances.a.intervall: unknown key" in message
    assert 'did you mean "interval"' in message


def test_unknown_global_key(tmp_path):
    message = error_for(tmp_path, minimal(top="metric_port = 9"))
    assert re.search(r": metric_port: unknown key \(did you mean \"metrics_port\"\?\)", message)


def test_unknown_restart_key(tmp_path):
    message = error_for(tmp_path, minimal(restart='type = "systemd"\nunit = "u"\nusr = true'))
    assert "instances.a.restart.usr: unknown key" in message and '"user"' in message


def test_bad_restart_type(tmp_path):
    message = error_for(tmp_path, minimal(restart='type = "lanchd"\nlabel = "x"'))
    assert "instances.a.restart.type: expected one of" in message
    assert '"launchd"' in message and 'got "lanchd"' in message


def test_missing_restart_type(tmp_path):
    message = error_for(tmp_path, minimal(restart='label = "x"'))
    assert "instances.a.restart.type: missing; expected one of" in message


def test_missing_restart_table(tmp_path):
    message = error_for(tmp_path, '[instances.a]\nurl = "http://127.0.0.1:8080"\n')
    assert "instances.a.restart: missing; expected a table" in message


def test_missing_url(tmp_path):
    message = error_for(tmp_path, '[instances.a]\nrestart = { type = "none" }\n')
    assert "instances.a.url: missing; expected a URL" in message


def test_missing_type_specific_key(tmp_path):
    message = error_for(tmp_path, minimal(restart='type = "launchd"'))
    assert "instances.a.restart.label: missing; expected a non-empty string" in message


@pytest.mark.parametrize(
    "line, key, expected",
    [
        ('interval = "5"', "interval", 'a number of seconds > 0, got "5"'),
        ("interval = -1", "interval", "a number of seconds > 0, got -1"),
        ("interval = true", "interval", "got true"),
        ("failures = 2.5", "failures", "a whole number >= 1, got 2.5"),
        ("failures = 0", "failures", "a whole number >= 1"),
        ("health_check = 1", "health_check", "true or false, got 1"),
        ('url = "127.0.0.1:8080"', "url", 'a URL like "http://127.0.0.1:8080"'),
        ('process_match = "(unclosed"', "process_match", "a valid regular expression"),
        ("pid = 0", "pid", "a whole number >= 1"),
        ("model = 7", "model", "a non-empty string, got 7"),
    ],
)
def test_wrong_types_name_key_and_expectation(tmp_path, line, key, expected):
    text = minimal(line) if not line.startswith("url") else minimal().replace(
        'url = "http://127.0.0.1:8080"', line
    )
    message = error_for(tmp_path, text)
    assert f"instances.a.{key}: expected " in message and expected in message, message


def test_argv_given_as_a_string(tmp_path):
    message = error_for(
        tmp_path, minimal(restart='type = "command"\nargv = "/usr/bin/restart-mlx --now"')
    )
    assert "instances.a.restart.argv: expected a list of strings" in message
    assert "not one string" in message


def test_argv_with_a_non_string(tmp_path):
    message = error_for(tmp_path, minimal(restart='type = "command"\nargv = ["x", 1]'))
    assert "instances.a.restart.argv: expected a list of strings" in message


@pytest.mark.parametrize("keys", ["", 'pid = 1\nmatch = "x"'])
def test_signal_needs_exactly_one_target(tmp_path, keys):
    message = error_for(tmp_path, minimal(restart=f'type = "signal"\n{keys}'))
    assert "instances.a.restart: expected exactly one of pid, pidfile or match" in message


def test_at_most_one_cpu_evidence_source(tmp_path):
    message = error_for(tmp_path, minimal('pid = 5\npidfile = "/x"'))
    assert "instances.a.pidfile: expected at most one of pid, pidfile, process_match" in message


def test_global_types(tmp_path):
    assert "metrics_port: expected a port number" in error_for(
        tmp_path, minimal(top="metrics_port = 70000")
    )
    assert 'log_format: expected one of "text", "json", got "xml"' in error_for(
        tmp_path, minimal(top='log_format = "xml"')
    )


def test_no_instances(tmp_path):
    assert "instances: missing; expected a table" in error_for(tmp_path, "metrics_port = 9000\n")
    assert "instances: expected at least one" in error_for(tmp_path, "[instances]\n")


def test_instance_must_be_a_table(tmp_path):
    assert "instances.a: expected a table, got 3" in error_for(tmp_path, "[instances]\na = 3\n")


def test_bad_instance_name(tmp_path):
    text = minimal().replace("[instances.a]", '[instances."my model"]').replace(
        "[instances.a.restart]", '[instances."my model".restart]'
    )
    assert 'instances.my model: instance names may hold' in error_for(tmp_path, text)


@pytest.mark.parametrize("name, shown", [("a\\n", "a\\x0a"), ("a\\u001b[2J", "a\\x1b[2J"),
                                         ("-a", "-a")])
def test_an_instance_name_that_could_forge_a_log_line_is_refused(tmp_path, name, shown):
    # "$" let "a\n" through: its log lines could forge others; ESC drives terminals.
    text = minimal().replace("[instances.a]", f'[instances."{name}"]').replace(
        "[instances.a.restart]", f'[instances."{name}".restart]')
    message = error_for(tmp_path, text)
    assert f"instances.{shown}: instance names may hold" in message
    assert "\n" not in message and "\x1b" not in message


def test_supervise_refuses_a_bad_name_and_names_a_v6_url_itself():
    from mlx_watchdog.config import name_from_url

    result = CliRunner().invoke(main, ["supervise", "--name", "a\nERROR forged", "--",
                                       "/nonexistent/server"])
    assert result.exit_code == 2 and "instance names may hold" in result.output
    assert "'a\\x0aERROR forged'" in result.output
    assert name_from_url("http://[::1]:8080/v1") == "[::1]:8080"


def test_api_key_env(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA_KEY", "from-env")
    config = load_config(write(tmp_path, minimal('api_key_env = "GEMMA_KEY"')))
    assert config.instances[0].api_key.reveal() == "from-env"
    monkeypatch.delenv("GEMMA_KEY")
    assert "instances.a.api_key_env: expected the name of a set environment variable" in (
        error_for(tmp_path, minimal('api_key_env = "GEMMA_KEY"'))
    )


def test_a_wrong_api_key_is_never_echoed(tmp_path):
    message = error_for(tmp_path, minimal("api_key = 12345678901"))
    assert "instances.a.api_key: expected a non-empty string" in message
    assert "12345678901" not in message


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.toml")


def test_watch_check_reports_errors_and_starts_nothing(tmp_path):
    bad = write(tmp_path, minimal(restart='type = "lanchd"'))
    result = CliRunner().invoke(main, ["watch", "--config", str(bad)])
    assert result.exit_code == 1
    assert "instances.a.restart.type: expected one of" in result.output
    good = tmp_path / "good.toml"
    good.write_text(GOOD)
    result = CliRunner().invoke(main, ["watch", "--config", str(good), "--check"])
    assert result.exit_code == 0 and "5 instance(s)" in result.output


def test_a_retired_key_still_starts_with_a_warning(tmp_path):
    # backoff_reset is gone (a start that served ends the backoff): an old
    # config must still start its watchdog, and say what to remove.
    path = write(tmp_path, minimal("backoff_reset = 600"))
    config = load_config(path)
    assert len(config.instances) == 1
    assert config.warnings == (f"{path}: instances.a.backoff_reset: no longer used: a start "
                               "that served ends the backoff at once (the next restart is "
                               "immediate); remove it",)
    result = CliRunner().invoke(main, ["watch", "--config", str(path), "--check"])
    assert result.exit_code == 0 and "backoff_reset: no longer used" in result.stderr


def test_supervise_still_takes_the_retired_backoff_reset_with_a_warning(tmp_path):
    result = CliRunner().invoke(main, [
        "supervise", "--backoff-reset", "600", "--state-file", str(tmp_path / "state.json"),
        "--report-dir", str(tmp_path / "reports"), "--url", "http://127.0.0.1:9", "--",
        str(tmp_path / "no-such-server")])
    assert result.exit_code == 1 and "cannot run" in result.output  # it got that far
    assert "--backoff-reset: no longer used" in result.output
