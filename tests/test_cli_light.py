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
        "type": "builtins.RuntimeError",
        "message": "[metal::malloc] Resource limit (499000) exceeded.",
        "traceback": "Traceback (most recent call last):\n  boom\n"},
        in_flight_requests=[{"max_tokens": 200, "prompt_tokens": 57, "stream": False}])
    newest = _report(tmp_path, "wedged", now, reason="heartbeat stale", stacks_text="Thread 0x1")
    runner = CliRunner()
    table = runner.invoke(main, ["reports", "--dir", str(tmp_path)]).output
    lines = table.splitlines()
    assert lines[0].split()[:6] == ["#", "ID", "TIME", "INSTANCE", "KIND", "CAUSE"]
    assert "wedged" in lines[1] and "died" in lines[2] and "Resource limit" in lines[2]
    assert lines[1].split()[6] == "-" and lines[2].split()[6] == "metal-buffer-count", lines
    listed = json.loads(runner.invoke(main, ["reports", "--dir", str(tmp_path), "--json"]).output)
    assert [r["kind"] for r in listed] == ["wedged", "died"]
    shown = runner.invoke(main, ["reports", "--dir", str(tmp_path), "show", newest.stem])
    assert json.loads(shown.output)["reason"] == "heartbeat stale"
    markdown = runner.invoke(main, ["reports", "--dir", str(tmp_path), "show", "2",
                                    "--markdown"]).output
    assert markdown.startswith("### mlx_lm.server: died: metal-buffer-count (RuntimeError: "
                               "[metal::malloc]")
    # The class leads (a report without a cause of its own is classified from
    # its exception), then the remedy, then the upstream issue to add to.
    assert markdown.index("**class:** `metal-buffer-count`") < markdown.index("**remedy:**") \
        < markdown.index("**upstream (add this report there):** mlx backend/metal") \
        < markdown.index("mlx-lm 0.32.2")
    assert "mlx-lm 0.32.2" in markdown and "prompt_tokens=57" in markdown
    assert "```" in markdown
    missing = runner.invoke(main, ["reports", "--dir", str(tmp_path), "show", "nope"])
    assert missing.exit_code == 1 and "no report 'nope'" in missing.output
    assert len(reports.report_files(tmp_path)) == 2


def test_reports_keep_the_newest_fifty(tmp_path):
    for i in range(55):
        _report(tmp_path, "died", 1_700_000_000 + i)
    assert len(reports.report_files(tmp_path)) == 50
    oldest = min(r["time"] for r in reports.load_reports(tmp_path))
    assert oldest == 1_700_000_005


def test_reports_escape_terminal_codes_in_fields_and_ignore_other_file_names(tmp_path):
    esc = "\x1b]0;owned\x07\x1b[2J"
    now = time.time()
    (tmp_path / reports.report_name("died", 42, now)).write_text(json.dumps({
        "kind": f"died{esc}", "time": now, "pid": 42, "reason": f"boom{esc}",
        "versions": {"mlx_lm": f"0.32.2{esc}"},
        "exception": {"type": f"builtins.RuntimeError{esc}", "message": f"bad{esc}",
                      "traceback": f"Traceback\n  line{esc}\n"}}))
    _report(tmp_path, "died", now + 1, reason="the newest")
    # Not a report name (contract.REPORT_NAME): not ours, neither listed nor pruned.
    planted = tmp_path / f"20991231-000000-000-died-1{esc}.json"
    planted.write_text(json.dumps({"kind": "died", "time": time.time() + 60, "pid": 1}))
    other = tmp_path / "notes.json"
    other.write_text("{}")
    assert len(reports.report_files(tmp_path)) == 2
    runner = CliRunner()
    for argv in (["reports"], ["reports", "--markdown"], ["reports", "show", "2", "--markdown"],
                 ["reports", "show", "1"], ["reports", "--json"]):
        result = runner.invoke(main, argv[:1] + ["--dir", str(tmp_path)] + argv[1:])
        assert result.exit_code == 0, (argv, result.output)
        assert "\x1b" not in result.output and "\x07" not in result.output, argv
    table = runner.invoke(main, ["reports", "--dir", str(tmp_path)]).output
    assert "\\x1b[2J" in table  # shown, escaped as `status` does
    markdown = runner.invoke(main, ["reports", "--dir", str(tmp_path), "show", "2",
                                    "--markdown"]).output
    assert "Traceback\n  line\\x1b]0;owned\\x07\\x1b[2J\n" in markdown  # lines kept
    reports.prune(tmp_path, keep=1)
    assert planted.exists() and other.exists() and len(reports.report_files(tmp_path)) == 1


MALFORMED = {
    "string-time": {"kind": "died", "time": "yesterday"},
    "huge-time": {"kind": "died", "time": 1e300},
    "string-exception": {"kind": "died", "time": 1.0, "exception": "boom"},
    "string-versions": {"kind": "died", "time": 1.0, "versions": "0.32.2"},
    "number-argv": {"kind": "died", "time": 1.0, "argv": ["--port", 8080]},
    "a-list": [1, 2, 3],
}


def test_a_malformed_report_is_marked_and_the_others_still_listed(tmp_path):
    good = _report(tmp_path, "died", time.time(), reason="a real one")
    ids = {}  # the file stem of each malformed report
    for pid, (name, data) in enumerate([*MALFORMED.items(), ("not-json", None)], 1):
        path = tmp_path / reports.report_name("died", pid, 1_700_000_000 + pid)
        path.write_text("{garbage" if data is None else json.dumps(data))
        ids[name] = path.stem
    runner = CliRunner()
    table = runner.invoke(main, ["reports", "--dir", str(tmp_path)])
    assert table.exit_code == 0 and "Traceback" not in table.output, table.output
    rows = table.output.splitlines()[1:]
    assert len(rows) == len(MALFORMED) + 2
    assert sum("unreadable report: " in row for row in rows) == len(MALFORMED) + 1
    assert any("a real one" in row for row in rows)
    row = next(r for r in rows if ids["string-time"] in r)
    assert "unreadable report: time is a string" in row
    listed = runner.invoke(main, ["reports", "--dir", str(tmp_path), "--json"])
    assert listed.exit_code == 0
    marks = {r["id"]: r.get("unreadable") for r in json.loads(listed.output)}
    assert marks[good.stem] is None and marks[ids["huge-time"]] == "time 1e+300 is not a date"
    assert marks[ids["a-list"]] == "a JSON list, not an object"
    assert marks[ids["not-json"]].startswith("not JSON")
    shown = runner.invoke(main, ["reports", "--dir", str(tmp_path), "show",
                                 ids["string-exception"]])
    assert shown.exit_code == 0
    assert json.loads(shown.output)["unreadable"] == "exception is a string"
    as_markdown = runner.invoke(main, ["reports", "--dir", str(tmp_path), "show",
                                       ids["string-exception"], "--markdown"])
    assert as_markdown.exit_code == 1
    assert (f"unreadable report {ids['string-exception']}: exception is a string"
            in as_markdown.output)
    newest = runner.invoke(main, ["reports", "--dir", str(tmp_path), "--markdown"])
    assert newest.exit_code == 0 and "a real one" in newest.output


def test_reports_name_their_instance_and_filter_by_it(tmp_path):
    now = time.time()
    _report(tmp_path, "died", now - 2, instance={"name": "qwen", "port": 8080, "model": "/m/q"},
            exception={"type": "builtins.OSError", "message": "Address already in use"},
            repeats=7, during_startup=True)
    _report(tmp_path, "died", now - 1, instance={"name": None, "port": 8081, "model": "/m/g"})
    _report(tmp_path, "wedged", now, instance="gemma")  # older watchdog reports: a name only
    runner = CliRunner()
    lines = runner.invoke(main, ["reports", "--dir", str(tmp_path)]).output.splitlines()
    assert [line.split()[4] for line in lines[1:]] == ["gemma", ":8081", "qwen"]
    assert "(7 times, at start-up) OSError: Address already in use" in lines[3]
    only = runner.invoke(main, ["reports", "--dir", str(tmp_path), "--instance", "qwen"])
    assert len(only.output.splitlines()) == 2 and " qwen " in only.output
    by_port = runner.invoke(main, ["reports", "--dir", str(tmp_path), "--instance", "8081"])
    assert len(by_port.output.splitlines()) == 2 and ":8081" in by_port.output
    none = runner.invoke(main, ["reports", "--dir", str(tmp_path), "--instance", "nobody"])
    assert "no reports in" in none.output and "for instance nobody" in none.output


def test_the_report_watcher_counts_only_its_instances_reports(tmp_path):
    from mlx_watchdog.report_watcher import ReportWatcher

    qwen = ReportWatcher(tmp_path, "qwen", 8080)
    gemma = ReportWatcher(tmp_path, "gemma", 8081)
    assert qwen.scan().new == 0 and gemma.scan().new == 0
    now = time.time()
    _report(tmp_path, "died", now, instance={"name": "qwen", "port": 8080, "model": "q"})
    _report(tmp_path, "died", now + 1, instance={"name": None, "port": 8081, "model": "g"})
    _report(tmp_path, "died", now + 2)  # names no instance: nobody's
    mine, theirs = qwen.scan(), gemma.scan()
    assert (mine.new, theirs.new) == (1, 1)
    assert "-died-" in mine.newest and mine.newest != theirs.newest
