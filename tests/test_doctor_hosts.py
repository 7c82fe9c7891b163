"""`doctor --hostfile` (mlx_watchdog.doctor_hosts): our own logic, with a fake ssh.

The real thing, over a real sshd to a second host, is in test_group_hosts.py.
There is no macOS here: the sleep check reads `pmset -g` output recorded on
real Macs (sources below), passed through the same probe answer a Mac would
send back.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from mlx_watchdog.doctor import format_report
from mlx_watchdog.doctor_hosts import FAIL, OK, check_hosts, pmset_settings, sleep_checks

# `pmset -g` on a Mac mini (macOS Sonoma, upgraded from Monterey), as printed in
# https://ezone.co.uk/setting-up-a-power-schedule-for-macos-with-pmset.html
# (the author's inline annotations removed, pmset's column layout restored).
PMSET_MAC_MINI = """\
System-wide power settings:
Currently in use:
 disksleep            10
 powernap             1
 womp                 1
 networkoversleep     0
 sleep                10 (sleep prevented by sharingd, powerd, bluetoothd)
 Sleep On Power Button 1
 ttyskeepawake        1
 tcpkeepalive         1
 autorestart          1
 standby              0
 displaysleep         10
"""

# `pmset -g` on a MacBook (macOS 12), as printed in
# https://real-world-systems.com/docs/pmset.1.html (its notes on sleepimage removed).
PMSET_MACBOOK = """\
System-wide power settings:
Currently in use:
 lidwake              1
 autopoweroff         1
 standbydelayhigh     86400
 autopoweroffdelay    28800
 standbydelaylow      10800
 standby              1
 proximitywake        0
 ttyskeepawake        1
 hibernatemode        3
 gpuswitch            2
 powernap             1
 hibernatefile        /var/vm/sleepimage
 highstandbythreshold 50
 displaysleep         28
 sleep                1 (sleep prevented by sharingd)
 acwake               0
 halfdim              1
 tcpkeepalive         1
 disksleep            0
"""

# The Mac mini's output after `sudo pmset -a sleep 0`, the fix doctor gives.
PMSET_NEVER_SLEEPS = PMSET_MAC_MINI.replace(
    " sleep                10 (sleep prevented by sharingd, powerd, bluetoothd)",
    " sleep                0")


def test_pmset_output_is_read_with_its_notes_and_names_with_spaces():
    settings = pmset_settings(PMSET_MAC_MINI)
    assert settings["sleep"] == ("10", "sleep prevented by sharingd, powerd, bluetoothd")
    assert settings["Sleep On Power Button"] == ("1", None)
    assert settings["displaysleep"] == ("10", None)
    assert "System-wide power settings:" not in settings
    assert pmset_settings(PMSET_MACBOOK)["hibernatefile"] == ("/var/vm/sleepimage", None)


def test_a_mac_that_sleeps_when_idle_fails_with_the_fix():
    for output, minutes in ((PMSET_MAC_MINI, "10"), (PMSET_MACBOOK, "1")):
        ((status, message, fix),) = sleep_checks("studio-2", output)
        assert status == FAIL
        assert f"studio-2: sleeps after {minutes} idle minute(s)" in message
        assert "sleep prevented by sharingd" in message  # held only for now
        assert "sudo pmset -a sleep 0" in fix
    ((status, message, _),) = sleep_checks("studio-2", PMSET_NEVER_SLEEPS)
    assert status == OK and "never sleeps" in message
    assert sleep_checks("studio-2", "pmset: command not found")[0][0] == "warn"


class FakeHosts:
    """subprocess.run for ssh and bash: each host answers the probe as configured."""

    def __init__(self, answers, unreachable=()):
        self.answers = answers  # host -> the probe's JSON (dict), or None: no python
        self.unreachable = set(unreachable)
        self.calls = []

    def __call__(self, argv, **kwargs):
        self.calls.append(argv)
        host = argv[-2] if argv[0] == "ssh" else "127.0.0.1"
        if host in self.unreachable:
            return subprocess.CompletedProcess(argv, 255, "", "Permission denied (publickey).")
        if argv[-1] == "true":
            return subprocess.CompletedProcess(argv, 0, "", "")
        answer = self.answers.get(host)
        if answer is None:
            return subprocess.CompletedProcess(argv, 127, "", "python: not found")
        return subprocess.CompletedProcess(
            argv, 0, "MLX-DOCTOR-HOST " + json.dumps(answer) + "\n", "")


def linux(mlx="0.32.4", lm="0.32.2", shim=True):
    return {"platform": "linux", "mlx": mlx, "mlx-lm": lm, "shim": shim}


def mac(pmset, **kwargs):
    return {**linux(**kwargs), "platform": "darwin", "pmset": pmset}


def hostfile(tmp_path: Path, *names) -> str:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([{"ssh": n, "ips": [f"10.0.0.{i}"]} for i, n in enumerate(names)]))
    return str(path)


def by_status(checks, status):
    return [message for s, message, _ in checks if s == status]


def test_every_host_is_checked_and_the_problems_are_named(tmp_path):
    path = hostfile(tmp_path, "localhost", "studio-2", "studio-3", "studio-4", "studio-5")
    run = FakeHosts({"127.0.0.1": mac(PMSET_NEVER_SLEEPS),
                     "studio-2": mac(PMSET_MAC_MINI, mlx="0.31.2", lm="0.31.3", shim=False),
                     "studio-4": None, "studio-5": linux()},
                    unreachable={"studio-3"})
    checks = check_hosts(path, python="/v/bin/python", shim_path="/there/shim", run=run)
    failed = "\n".join(by_status(checks, FAIL))
    assert "studio-3: not reachable by `ssh -o BatchMode=yes studio-3`" in failed
    assert "studio-2: no hotfix shim at /there/shim" in failed
    assert "studio-2: sleeps after 10 idle minute(s)" in failed
    assert "studio-4: cannot run /v/bin/python there" in failed
    assert ("the hosts run different releases (127.0.0.1: mlx 0.32.4, mlx-lm 0.32.2; "
            "studio-2: mlx 0.31.2, mlx-lm 0.31.3; studio-5: mlx 0.32.4, mlx-lm 0.32.2)") in failed
    assert "studio-5: reachable by ssh" in by_status(checks, OK)
    assert "127.0.0.1: never sleeps when idle (pmset sleep 0)" in by_status(checks, OK)
    fixes = {message.split(":")[0]: fix for s, message, fix in checks if s == FAIL}
    assert "ssh-copy-id studio-3" in fixes["studio-3"]
    # This machine is probed without ssh, with this installation's shim.
    local = [argv for argv in run.calls if argv[0] == "bash"]
    assert len(local) == 1 and "/there/shim" not in local[0][-1]
    assert not any("localhost" in argv for argv in run.calls)


def test_a_good_group_passes_with_one_line_per_finding(tmp_path):
    path = hostfile(tmp_path, "127.0.0.1", "studio-2")
    run = FakeHosts({"127.0.0.1": linux(), "studio-2": mac(PMSET_NEVER_SLEEPS)})
    checks = check_hosts(path, python="/v/bin/python", shim_path="/there/shim", run=run)
    assert by_status(checks, FAIL) == [] and by_status(checks, "warn") == []
    assert "every host runs mlx 0.32.4, mlx-lm 0.32.2" in by_status(checks, OK)
    assert "studio-2: the hotfix shim is at /there/shim" in by_status(checks, OK)
    report = {"groups": [{"title": "hosts", "checks": [
        {"status": s, "message": m, "fix": f} for s, m, f in checks]}],
        "counts": {OK: len(checks), "warn": 0, FAIL: 0}}
    text = format_report(report)
    assert text.splitlines()[1].startswith("  ✓ hostfile ")
    assert "fix:" not in text


def test_a_bad_hostfile_is_one_failure_with_its_fix(tmp_path):
    ((status, message, fix),) = check_hosts(str(tmp_path / "missing.json"))
    assert status == FAIL and "does not exist" in message and '"ssh"' in fix
