"""The Linux OOM killer's record of a pid (watchdog/mlx_watchdog/oomkill.py),
on recorded real kernel lines: this machine's (/dev/kmsg and dmesg, a memory
cgroup's kill on Linux 6.18, tests/data/signatures/) and those quoted in
upstream issues (journald, dmesg -T, an older kernel's wording)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from mlx_watchdog import oomkill

DATA = Path(__file__).parent / "data" / "signatures"

# docker/for-linux #1001: journald's short format, two kills in a row
JOURNAL = (DATA / "journal-oom-docker-for-linux-1001.txt").read_text().splitlines()

# 0jc1/py-autovod #7: dmesg -T, with the summary line first (the issue printed
# thousands separators in two numbers; here they are as the kernel writes them)
DMESG_T = (DATA / "dmesg-T-oom-py-autovod-7.txt").read_text().splitlines()

# intel/platform-resource-manager #42: a 2019 kernel's wording
OLD_KERNEL = (DATA / "dmesg-T-oom-old-kernel-platform-resource-manager-42.txt").read_text().splitlines()


def test_a_memory_cgroup_kill_recorded_from_dev_kmsg():
    lines = (DATA / "kmsg-memcg-oom-linux-6.18.txt").read_text().splitlines()
    found = oomkill.parse_oom_kill(5598, lines, "/dev/kmsg")
    assert found is not None
    assert (found.pid, found.process, found.anon_rss_kb, found.total_vm_kb) == (
        5598, "python3", 65280, 75160)
    assert found.cgroup and found.constraint == "CONSTRAINT_MEMCG"
    assert found.line.startswith("3,417,1094383740,-;Memory cgroup out of memory: Killed process")
    assert found.as_detail() == {"by": "oom-killer", "pid": 5598, "process": "python3",
                                 "cgroup": True, "kernel_log": "/dev/kmsg", "anon_rss_kb": 65280,
                                 "total_vm_kb": 75160, "constraint": "CONSTRAINT_MEMCG"}


def test_the_same_kill_from_dmesg():
    lines = (DATA / "dmesg-memcg-oom-linux-6.18.txt").read_text().splitlines()
    found = oomkill.parse_oom_kill(5598, lines, "dmesg")
    assert found is not None and found.cgroup and found.anon_rss_kb == 65280


def test_a_machine_wide_kill_from_the_journal_and_dmesg_t():
    found = oomkill.parse_oom_kill(15783, JOURNAL, "journalctl -k")
    assert (found.pid, found.process, found.anon_rss_kb, found.cgroup, found.constraint) == (
        15783, "python3", 4288, False, None)
    found = oomkill.parse_oom_kill(7899, DMESG_T)
    assert found.constraint == "CONSTRAINT_NONE" and not found.cgroup
    assert found.anon_rss_kb == 15370088


def test_an_older_kernel_and_only_the_pid_asked_for():
    found = oomkill.parse_oom_kill(89746, OLD_KERNEL)
    assert found.total_vm_kb == 118026216 and found.process == "python"
    assert oomkill.parse_oom_kill(89879, OLD_KERNEL).anon_rss_kb == 0
    # Another pid's kill, a reaper line, a pid that is a prefix of another: nothing.
    assert oomkill.parse_oom_kill(1578, JOURNAL) is None
    assert oomkill.parse_oom_kill(4242, JOURNAL + DMESG_T + OLD_KERNEL) is None
    # A summary for the pid without the kill record that follows it is not a kill.
    assert oomkill.parse_oom_kill(7899, DMESG_T[:1]) is None


def test_the_first_readable_log_that_has_it():
    calls = []

    def unreadable():
        calls.append("kmsg")
        raise PermissionError(1, "Operation not permitted", "/dev/kmsg")

    def dmesg():
        calls.append("dmesg")
        raise OSError("dmesg exited 1: dmesg: read kernel buffer failed: Operation not permitted")

    def journal():
        calls.append("journal")
        return JOURNAL

    found = oomkill.find_oom_kill(15784, [("/dev/kmsg", unreadable), ("dmesg", dmesg),
                                          ("journalctl -k", journal)])
    assert calls == ["kmsg", "dmesg", "journal"]
    assert found.source == "journalctl -k" and found.anon_rss_kb == 4288
    # The ring buffer was read but has nothing (overwritten): the journal still may.
    found = oomkill.find_oom_kill(15784, [("dmesg", lambda: ["[1.0] booting"]),
                                          ("journalctl -k", journal)])
    assert found.source == "journalctl -k"


def test_nothing_readable_is_none_never_an_error():
    def boom():
        raise FileNotFoundError(2, "No such file or directory", "journalctl")

    def garbage():
        return [None, 42]  # not lines at all

    assert oomkill.find_oom_kill(1, [("a", boom), ("b", garbage)]) is None
    assert oomkill.find_oom_kill(1, []) is None


def test_read_kmsg_reads_records_until_the_end(tmp_path):
    # A regular file stands in for the device: records, then the end.
    path = tmp_path / "kmsg"
    path.write_text("6,1,100,-;first\n")
    assert oomkill.read_kmsg(str(path)) == ["6,1,100,-;first\n"]


def test_read_kmsg_on_the_real_device():
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg is not readable here")
    try:
        records = oomkill.read_kmsg()
    except PermissionError:
        pytest.skip("/dev/kmsg is not readable here (CAP_SYSLOG)")
    assert records, "the kernel's ring buffer is never empty"
    assert all(re.match(r"\d+,\d+,\d+,[^;]*;", record) for record in records[:50])
    # One record per read: the first is the kernel's own banner.
    assert "Linux version" in records[0] or len(records) > 1
