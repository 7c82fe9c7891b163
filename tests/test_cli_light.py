"""The CLI attaches its commands lazily; `probe` stays light; `reports` reads reports."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from click.testing import CliRunner

from mlx_watchdog import reports
from mlx_watchdog.cli import main

HEAVY = ("prometheus_client", "mlx_watchdog.install.cli", "mlx_watchdog.daemon_cli",
         "mlx_watchdog.install.instance", "mlx_watchdog.metrics", "mlx_watchdog.supervise",
         "psutil")


def test_probe_imports_only_what_it_needs():
    code = (
        "import sys\n"
        "sys.argv = ['mlx-watchdog', 'probe', '--url', 'http://127.0.0.1:9', '--timeout', '1']\n"
        "from mlx_watchdog.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    loaded = done.stdout.strip().splitlines()[-1]
    assert '"status": "unreachable"' in done.stdout, done.stderr
    for name in HEAVY:
        assert f"'{name}'" not in loaded, name
    assert "'mlx_watchdog.probe_cli'" in loaded  # the control: the list is real


def test_every_command_is_listed_and_runs():
    result = CliRunner().invoke(main, ["--help"])
    for name in ("probe", "supervise", "watch", "status", "install", "uninstall", "reports",
                 "shim-path", "exec"):
        assert name in result.output
    assert CliRunner().invoke(main, ["supervise", "--help"]).exit_code == 0


def _report(directory, kind, when, **fields):
    data = {"kind": kind, "time": when, "pid": 42, "versions": {"mlx_lm": "0.32.2"},
            "in_flight": 1, **fields}
    return reports.write_report(directory, data)


def test_reports_table_json_show_and_markdown(tmp_path):
    now = time.time()
    _report(tmp_path, "died", now - 60, exception={
        "type": "builtins.RuntimeError", "message": "[metal::malloc] Resource limit",
        "traceback": "Traceback (most recent call last):\n  boom\n"},
        in_flight_requests=[{"max_tokens": 200, "prompt_tokens": 57, "stream": False}])
    newest = _report(tmp_path, "wedged", now, reason="heartbeat stale", stacks_text="Thread 0x1")
    runner = CliRunner()
    table = runner.invoke(main, ["reports", "--dir", str(tmp_path)]).output
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["#", "ID", "TIME", "KIND"]
    assert "wedged" in lines[1] and "died" in lines[2] and "Resource limit" in lines[2]
    listed = json.loads(runner.invoke(main, ["reports", "--dir", str(tmp_path), "--json"]).output)
    assert [r["kind"] for r in listed] == ["wedged", "died"]
    shown = runner.invoke(main, ["reports", "--dir", str(tmp_path), "show", newest.stem])
    assert json.loads(shown.output)["reason"] == "heartbeat stale"
    markdown = runner.invoke(main, ["reports", "--dir", str(tmp_path), "show", "2",
                                    "--markdown"]).output
    assert markdown.startswith("### mlx_lm.server: died (RuntimeError: [metal::malloc]")
    assert "mlx-lm 0.32.2" in markdown and "prompt_tokens=57" in markdown
    assert "```" in markdown
    missing = runner.invoke(main, ["reports", "--dir", str(tmp_path), "show", "nope"])
    assert missing.exit_code == 1 and "no report 'nope'" in missing.output
    assert reports.count_reports(tmp_path) == 2


def test_reports_keep_the_newest_fifty(tmp_path):
    for i in range(55):
        _report(tmp_path, "died", 1_700_000_000 + i)
    assert reports.count_reports(tmp_path) == 50
    oldest = min(r["time"] for r in reports.load_reports(tmp_path))
    assert oldest == 1_700_000_005
