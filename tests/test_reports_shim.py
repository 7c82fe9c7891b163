"""Crash reports from the shim, on the real stock servers (subprocesses)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.conftest import fault_env
from harness.server import VERSIONS, BackgroundRequest, run_python

SECRET_PROMPT = "zebra-quartz-lantern " * 30  # must never reach a report
CLIENT_TIMEOUT = 90


def _reports(directory):
    return sorted(p for p in directory.glob("*.json"))


@pytest.mark.server
@pytest.mark.parametrize("version", VERSIONS)
def test_death_writes_one_report_without_the_prompt(servers, tiny_llama, tmp_path, version):
    arm, reports = tmp_path / "arm", tmp_path / "reports"
    env = fault_env("raise:resource:decode:2", arm)
    env["MLX_HOTFIX_REPORT_DIR"] = str(reports)
    server = servers(version, tiny_llama, env=env)
    server.warm_up()
    arm.touch()
    request = BackgroundRequest(
        lambda: server.chat(SECRET_PROMPT, max_tokens=200, timeout=CLIENT_TIMEOUT, top_p=0.9))
    assert server.wait_exit(CLIENT_TIMEOUT) == 70, server.log()
    request.join(CLIENT_TIMEOUT)

    files = _reports(reports)
    assert len(files) == 1, (files, server.log())
    assert oct(files[0].stat().st_mode & 0o777) == "0o600"
    text = files[0].read_text()
    assert "zebra-quartz-lantern" not in text
    report = json.loads(text)
    assert report["kind"] == "died" and report["pid"] == server.proc.pid
    assert report["exit_code"] == 70
    assert report["exception"]["type"] == "builtins.RuntimeError"
    assert "Resource limit" in report["exception"]["message"]
    assert "Traceback" in report["exception"]["traceback"]
    assert report["versions"]["mlx_lm"] == version
    assert report["in_flight"] == 1, report["in_flight_requests"]
    shape = report["in_flight_requests"][0]
    assert shape["max_tokens"] == 200 and shape["stream"] is False and shape["top_p"] == 0.9
    assert shape["prompt_tokens"] and shape["prompt_tokens"] > 30
    assert "_generate" in report["exception"]["traceback"]
    assert any(s["thread"] == "mlx-hotfix-exit" for s in report["stacks"])
    assert report["memory"].get("rss_bytes") or report["memory"].get("peak_rss_bytes")
    assert "exit applied" in report["status"]
    # A death leaves its stack files behind (os._exit); the next start tidies them.
    assert not [p for p in reports.iterdir() if p.name.startswith("fatal-")
                and p.stat().st_size > 0]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_fatal_signal_lands_in_a_report_at_the_next_start(envs, tmp_path, version):
    reports = tmp_path / "reports"
    env = {"MLX_HOTFIX_REPORT_DIR": str(reports)}
    code = "import mlx_lm.server, os, signal; os.kill(os.getpid(), signal.SIGABRT)"
    first = run_python(version, code, env=env)
    assert first.returncode == -signal.SIGABRT
    fatal = list(reports.glob("fatal-*.txt"))
    assert len(fatal) == 1 and "Aborted" in fatal[0].read_text()
    second = run_python(version, "import mlx_lm.server", env=env)
    assert second.returncode == 0, second.stderr
    files = _reports(reports)
    assert len(files) == 1 and "folded into" in second.stderr
    assert "Fatal Python error: Aborted" in second.stderr  # the service log gets them too
    report = json.loads(files[0].read_text())
    assert report["kind"] == "aborted" and "Fatal Python error: Aborted" in report["fatal_stacks"]
    assert not list(reports.glob("fatal-*.txt")) or all(
        p.stat().st_size == 0 for p in reports.glob("fatal-*.txt"))


def test_sigusr1_writes_every_threads_stack_and_the_process_lives(envs, tmp_path):
    reports = tmp_path / "reports"
    code = (
        "import mlx_lm.server, os, signal, time, threading\n"
        "def parked_here():\n    threading.Event().wait()\n"
        "threading.Thread(target=parked_here, daemon=True).start()\n"
        "time.sleep(0.2); os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.2)\n"
        "print(open(os.path.join(os.environ['MLX_HOTFIX_REPORT_DIR'],"
        " 'stacks-%d.txt' % os.getpid())).read())\n"
    )
    done = run_python(VERSIONS[-1], code, env={"MLX_HOTFIX_REPORT_DIR": str(reports)})
    assert done.returncode == 0, done.stderr
    assert "parked_here" in done.stdout and done.stdout.lower().count("thread 0x") >= 2
    assert not list(reports.glob("stacks-*.txt"))  # a clean exit tidies up


def test_write_report_never_raises_and_keeps_the_newest(envs, tmp_path):
    reports = tmp_path / "reports"
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from mlx_hotfix import reports\n"
        "paths = [reports.write_report('died', exc=ValueError('x%d' % i)) for i in range(55)]\n"
        "assert all(paths), paths\n"
        "import os; os.environ['MLX_HOTFIX_REPORT_DIR'] = '/proc/no/such/dir'\n"
        "assert reports.write_report('died') is None\n"
        "assert reports.redact_argv(['-m', '--api-key', 'K1', '--token=K2', '--port', '1'])"
        " == ['-m', '--api-key', '***', '--token=***', '--port', '1']\n"
        "print(len(reports.report_names(sys.argv[2])))\n"
    )
    from harness.server import SHIM_DIR

    done = run_python(VERSIONS[-1], code, shim=False, args=[str(SHIM_DIR), str(reports)],
                      env={"MLX_HOTFIX_REPORT_DIR": str(reports)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "50"
    assert "could not write a died report" in done.stderr


def test_links_planted_at_the_stack_file_names_are_replaced_never_followed(envs, tmp_path):
    # A shared report folder: someone plants fatal-<pid>.txt and stacks-<pid>.txt
    # as links to the owner's files before the server starts, and a link named
    # like a dead process's fatal file to a secret.
    reports, victims = tmp_path / "reports", tmp_path / "victims"
    victims.mkdir()
    precious = {name: victims / name for name in ("fatal", "stacks", "secret")}
    for path in precious.values():
        path.write_text("Fatal Python error: Aborted\nprecious %s\n" % path.name)
        path.chmod(0o644)
    reports.mkdir()
    (reports / "fatal-999999999.txt").symlink_to(precious["secret"])
    code = (
        "import os, sys\n"
        "d = os.environ['MLX_HOTFIX_REPORT_DIR']\n"
        "for prefix, victim in (('fatal-', sys.argv[1]), ('stacks-', sys.argv[2])):\n"
        "    os.symlink(victim, os.path.join(d, '%s%d.txt' % (prefix, os.getpid())))\n"
        "import mlx_lm.server\n"
        "print([os.path.islink(os.path.join(d, '%s%d.txt' % (p, os.getpid())))"
        " for p in ('fatal-', 'stacks-')])\n"
    )
    done = run_python("0.31.3", code, args=[str(precious["fatal"]), str(precious["stacks"])],
                      env={"MLX_HOTFIX_REPORT_DIR": str(reports)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[False, False]"  # our own files replaced the links
    for name, path in precious.items():
        assert path.read_text() == "Fatal Python error: Aborted\nprecious %s\n" % name
        assert oct(path.stat().st_mode & 0o777) == "0o644", name
    assert "precious secret" not in done.stderr and not _reports(reports)


def test_pruning_touches_only_report_names_and_never_the_report_just_written(envs, tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    foreign = ["notes.json", "zzz.json", "20990101-config.json", "20990101-000000-000-Died-1.json"]
    for name in foreign:
        (reports / name).write_text("{}")
    old = ["20000101-000000-00%d-died-1.json" % i for i in range(3)]
    # Reports from a clock that ran ahead: all newer by name than the next one.
    ahead = ["20990101-000000-%03d-died-2.json" % i for i in range(50)]
    for name in old + ahead:
        (reports / name).write_text("{}")
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from mlx_hotfix import reports\n"
            "print(reports.write_report('died'))\n")
    from harness.server import SHIM_DIR

    done = run_python(VERSIONS[-1], code, shim=False, args=[str(SHIM_DIR)],
                      env={"MLX_HOTFIX_REPORT_DIR": str(reports)})
    assert done.returncode == 0, done.stderr
    written = done.stdout.strip()
    assert Path(written).parent == reports and Path(written).exists()
    left = sorted(p.name for p in reports.iterdir())
    assert set(foreign) <= set(left)
    assert not set(old) & set(left)
    assert len([n for n in left if n not in foreign]) == 50


@pytest.mark.parametrize("setting,whole", [("", False), ("1", True), ("maybe", False)])
def test_report_messages_are_redacted_unless_asked_for_whole(envs, tmp_path, setting, whole):
    code = ("import json, sys; sys.path.insert(0, sys.argv[1])\n"
            "from mlx_hotfix import config, log, reports\n"
            "for warning in config.current().warnings: log.say(warning)\n"
            "try:\n"
            "    raise ValueError(\"bad 'the secret prompt' [1, 2, 3, 4, 5, 6, 7, 8]\")\n"
            "except ValueError as exc:\n"
            "    print(json.dumps(reports._exception(exc)))\n")
    from harness.server import SHIM_DIR

    done = run_python(VERSIONS[-1], code, shim=False, args=[str(SHIM_DIR)],
                      env={"MLX_HOTFIX_REPORT_MESSAGES": setting})
    assert done.returncode == 0, done.stderr
    exception = json.loads(done.stdout)
    assert exception["message_redacted"] is not whole
    if whole:
        assert exception["message"] == "bad 'the secret prompt' [1, 2, 3, 4, 5, 6, 7, 8]"
    else:
        assert exception["message"] == "bad '<redacted 17 chars>' [<redacted 8 numbers>]"
        assert "secret" not in exception["traceback"]
    assert ("MLX_HOTFIX_REPORT_MESSAGES='maybe' is not 0/1; using 0" in done.stderr) is (
        setting == "maybe")
