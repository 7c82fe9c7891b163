"""One contract between the shim and the watchdog (sitecustomize/mlx_hotfix/contract.py).

The shim imports it; the watchdog loads it by path (mlx_watchdog/contract.py);
monitoring/ uses its restart causes. These tests fail when a side types a
contract name itself, or when the two drift apart.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from mlx_watchdog import contract, defaults, heartbeat, judge, monitor, redact, reports

REPO = Path(__file__).resolve().parents[1]
SHIM = REPO / "sitecustomize"
CONTRACT_FILE = SHIM / "mlx_hotfix" / "contract.py"


def test_the_watchdog_loads_the_shims_own_file():
    assert Path(contract.SHIM_MODULE.__file__).resolve() == CONTRACT_FILE
    assert "mlx_hotfix" not in sys.modules  # loaded as data, never as the shim's package


def test_the_restart_causes_are_one_vocabulary():
    assert monitor.RESTART_CAUSES == contract.RESTART_CAUSES, (
        "a new restart cause goes into RESTART_CAUSES (and, if the server was alive but not "
        "serving, WEDGED_CAUSES) of sitecustomize/mlx_hotfix/contract.py; monitor.py uses it")
    assert contract.PORT_TAKEN in monitor.RESTART_CAUSES  # the cause monitor.py used to miss
    assert len(set(contract.RESTART_CAUSES)) == len(contract.RESTART_CAUSES)
    assert set(contract.WEDGED_CAUSES) <= set(contract.RESTART_CAUSES)
    # Every cause the judge can give is one the metrics count from zero.
    causes = {value for name, value in vars(judge).items()
              if name.isupper() and isinstance(value, str)
              and value not in judge.STATES and value not in contract.PHASES}
    assert causes and causes <= set(contract.RESTART_CAUSES), (
        f"judge.py gives causes {sorted(causes - set(contract.RESTART_CAUSES))} that "
        "sitecustomize/mlx_hotfix/contract.py RESTART_CAUSES lacks: define them there and "
        "use contract.NAME in judge.py")
    assert monitor.PLANNED == contract.PLANNED


def _restart_alert_regex():
    rules = yaml.safe_load((REPO / "monitoring" / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "MLXRestartedWedged":
                found = re.search(r'reason=~"([^"]*)"', rule["expr"])
                assert found, rule["expr"]
                return found.group(1)
    raise AssertionError("monitoring/alerts.yml has no MLXRestartedWedged alert")


def test_the_alert_regex_is_the_contracts_wedged_causes():
    assert _restart_alert_regex() == "|".join(contract.WEDGED_CAUSES), (
        'monitoring/alerts.yml MLXRestartedWedged: set reason=~"%s" (contract.WEDGED_CAUSES)'
        % "|".join(contract.WEDGED_CAUSES))


def test_every_reason_in_monitoring_is_a_restart_cause():
    text = "".join((REPO / "monitoring" / name).read_text()
                   for name in ("alerts.yml", "alerts-test.yml", "grafana-dashboard.json"))
    reasons = set()
    for value in re.findall(r'reason=~?\\?"([^"\\]*)', text):
        reasons.update(value.split("|"))
    assert reasons, "no reason label found in monitoring/"
    assert reasons <= set(contract.RESTART_CAUSES), reasons - set(contract.RESTART_CAUSES)


def test_the_watchdog_takes_the_shared_names_from_the_contract():
    assert defaults.HEARTBEAT_ENV == contract.HEARTBEAT_FILE_ENV
    assert defaults.REPORT_DIR_ENV == contract.REPORT_DIR_ENV
    assert defaults.INSTANCE_ENV == contract.INSTANCE_ENV
    assert defaults.DRAIN_TIMEOUT_ENV == contract.DRAIN_TIMEOUT_ENV
    assert defaults.SHIM_EXIT_CODE == contract.EXIT_CODE
    assert (reports.KEEP, reports.SCHEMA) == (contract.KEEP, contract.SCHEMA)
    assert (heartbeat.LOADING, heartbeat.SERVING, heartbeat.STALLED) == contract.PHASES
    assert reports.stacks_file(Path("/r"), 7) == Path("/r") / contract.stacks_name(7)
    assert redact.redact_argv(["--api-key", "K", "--auth-token=T", "-m", "x"]) == [
        "--api-key", "***", "--auth-token=***", "-m", "x"]


# A contract name typed as a literal anywhere but contract.py is a second
# definition waiting to drift.
_LITERALS = re.compile(
    r"""["'](?:MLX_HOTFIX_(?:REPORT_DIR|HEARTBEAT_FILE|INSTANCE|PARENT_PID|LAUNCHD_SOCKET|"""
    r"""DRAIN_TIMEOUT|STALL_TIMEOUT|DISABLE)|stacks-|fatal-|passwd|not-running|dead-thread|"""
    r"""heartbeat-stale|no-progress|bad-answer|busy-too-long|port-taken)["']|\.rank%d|"""
    r"""["']mlx-watchdog["'],\s*["']reports["']|\.json\\Z""")


def test_no_side_types_a_contract_name_itself():
    found = []
    for folder in (SHIM, REPO / "watchdog" / "mlx_watchdog"):
        for path in sorted(folder.rglob("*.py")):
            if path.name == "contract.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if _LITERALS.search(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "use the contract's name (sitecustomize/mlx_hotfix/contract.py):\n" + \
        "\n".join(found)


def test_the_shim_writes_what_the_contract_says(tmp_path):
    """In a subprocess (the shim's own modules, no mlx_lm): its record's fields,
    its report names and redaction are the contract's."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1])\n"
        "from mlx_hotfix import admission, contract, group, heartbeat, reports\n"
        "heartbeat.add_fields(admission.Gate().fields)\n"
        "record = heartbeat.record('serving')\n"
        "assert reports.redact_argv is contract.redact_argv\n"
        "assert reports.report_name is contract.report_name and reports.prune is contract.prune\n"
        "assert reports.stacks_path(7, '/r') == '/r/' + contract.stacks_name(7)\n"
        "assert reports.fatal_path(7, '/r') == '/r/' + contract.fatal_name(7)\n"
        "assert group.heartbeat_path('/h', {'MLX_RANK': '2'}) == contract.rank_file('/h', 2)\n"
        "print(json.dumps({'record': sorted(record), 'dir': reports.report_dir()}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(SHIM)], capture_output=True,
                          text=True, timeout=60,
                          env={"MLX_HOTFIX_REPORT_DIR": str(tmp_path / "r"), "PATH": "/usr/bin"})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(out["record"]) <= set(contract.HEARTBEAT_FIELDS), \
        set(out["record"]) - set(contract.HEARTBEAT_FIELDS)
    assert set(contract.HEARTBEAT_REQUIRED) <= set(out["record"])
    assert out["dir"] == str(tmp_path / "r")
    assert contract.RANK_FILE.search(contract.rank_file("/h", 3))


def test_report_names_and_pruning_are_one_rule(tmp_path):
    names = [contract.report_name("died", 10 + i, 1_700_000_000 + i) for i in range(5)]
    assert all(contract.REPORT_NAME.match(n) for n in names)
    for name in [*names, "notes.json", ".hidden.json", "stacks-1.txt"]:
        (tmp_path / name).write_text("{}")
    reports.prune(tmp_path, keep=2)  # the watchdog's
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([*names[-2:], "notes.json", ".hidden.json", "stacks-1.txt"])
    assert [p.name for p in reports.report_files(tmp_path)] == names[-2:]
