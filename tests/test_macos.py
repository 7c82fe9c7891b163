"""The macOS readers, on Linux: the real formats as data (tests/data/macos,
README there says where each comes from), and the fallbacks that run here."""

from __future__ import annotations

import os
import shutil
import struct
import sys
import threading
from pathlib import Path

import pytest

from harness import SHIM_DIR
from mlx_watchdog import macos
from mlx_watchdog.memory import GiB, LimitSpec, Machine, resolve_limit

DATA = Path(__file__).parent / "data" / "macos"
JETSAM = DATA / "JetsamEvent-2026-05-15-220357.ips"


def fake_runner(outputs):
    """A runner answering argv from a table (None: the command failed)."""
    calls = []

    def runner(argv):
        calls.append(list(argv))
        return outputs.get(" ".join(argv))

    runner.calls = calls
    return runner


# -- proc_pid_rusage: the struct of <sys/resource.h> -----------------------------------


def test_rusage_info_v4_has_the_layout_of_the_header():
    reader = macos._footprint_reader()  # the shim's footprint.py, loaded by path
    assert Path(reader.__file__) == SHIM_DIR / "mlx_hotfix" / "footprint.py"
    import ctypes

    layout = reader.rusage_struct()
    assert reader.RUSAGE_INFO_V4 == 4
    assert ctypes.sizeof(layout) == 16 + 35 * 8 == 296
    assert (layout.ri_wired_size.offset, layout.ri_resident_size.offset,
            layout.ri_phys_footprint.offset) == (56, 64, 72)
    assert layout.ri_lifetime_max_phys_footprint.offset == 16 + 28 * 8
    assert layout.ri_runnable_time.offset == 288


def test_a_raw_rusage_buffer_decodes_to_the_named_bytes():
    values = list(range(1000, 1035))
    values[5], values[6], values[7] = 3 * GiB, 40 * GiB, 51 * GiB  # wired, resident, footprint
    values[28] = 60 * GiB  # lifetime max footprint
    raw = bytes(range(16)) + struct.pack("<35Q", *values)
    assert macos._footprint_reader().decode(raw) == {
        "phys_footprint": 51 * GiB, "resident_size": 40 * GiB, "wired_size": 3 * GiB,
        "lifetime_max_phys_footprint": 60 * GiB}


def test_footprint_falls_back_to_none_off_macos():
    assert sys.platform != "darwin"
    assert macos.footprint(os.getpid()) is None
    assert macos._footprint_reader().read(os.getpid()) is None


# -- sysctl, RAM and the GPU wired cap, and memory_limit = auto --------------------------


def test_sysctl_readers_on_a_mac():
    runner = fake_runner({"/usr/sbin/sysctl -n hw.memsize": "68719476736\n",
                          "/usr/sbin/sysctl -n iogpu.wired_limit_mb": "57344\n"})
    assert macos.ram_bytes(runner=runner, platform="darwin") == 64 * GiB
    assert macos.gpu_wired_limit_bytes(runner=runner, platform="darwin") == 56 * GiB


def test_the_gpu_wired_cap_unset_and_before_macos_14():
    unset = fake_runner({"/usr/sbin/sysctl -n iogpu.wired_limit_mb": "0\n"})
    assert macos.gpu_wired_limit_bytes(runner=unset, platform="darwin") is None
    assert len(unset.calls) == 1  # 0 is "the default cap", not "no such knob"
    ventura = fake_runner({"/usr/sbin/sysctl -n debug.iogpu.wired_limit": "49392123904\n"})
    assert macos.gpu_wired_limit_bytes(runner=ventura, platform="darwin") == 49392123904


def test_sysctl_and_ram_fall_back_on_linux():
    runner = fake_runner({})
    assert macos.sysctl("hw.memsize", runner=runner) is None and runner.calls == []
    assert macos.ram_bytes() > 0  # psutil
    machine = macos.machine()
    assert machine.system == sys.platform and machine.ram_bytes > 0
    assert machine.gpu_wired_limit_bytes is None and machine.recommended_working_set is None
    assert resolve_limit(LimitSpec("auto"), machine).bytes is None


@pytest.mark.parametrize("ram, cap, recommended, expected", [
    (64 * GiB, 48 * GiB, None, 48 * GiB),  # the GPU cap set lower than RAM - 8G
    (64 * GiB, None, int(51.5 * GiB), int(51.5 * GiB)),  # MLX's working set, default cap
    (192 * GiB, None, 144 * GiB, 144 * GiB),
    (128 * GiB, 124 * GiB, None, 120 * GiB),  # RAM minus the 8 GiB reserve
    (8 * GiB, None, None, 4 * GiB),  # under 16 GiB the reserve is 4 GiB
])
def test_auto_on_a_mac(ram, cap, recommended, expected):
    machine = Machine("darwin", ram_bytes=ram, gpu_wired_limit_bytes=cap,
                      recommended_working_set=recommended)
    limit = resolve_limit(LimitSpec("auto"), machine)
    assert limit.bytes == expected and "auto" in limit.reason


def test_auto_on_a_mac_from_the_readers():
    runner = fake_runner({"/usr/sbin/sysctl -n hw.memsize": str(96 * GiB),
                          "/usr/sbin/sysctl -n iogpu.wired_limit_mb": str(80 * 1024)})
    machine = macos.machine(runner=runner, platform="darwin")
    assert resolve_limit(LimitSpec("auto"), machine).bytes == 80 * GiB


# -- vm_stat: the machine's wired memory ------------------------------------------------


def test_wired_memory_from_vm_stat():
    text = (DATA / "vm_stat.txt").read_text()
    counters = macos.parse_vm_stat(text)
    assert counters["page size"] == 16384 and counters["Translation faults"] == 1234567890
    assert macos.wired_from_vm_stat(text) == 456789 * 16384
    runner = fake_runner({"/usr/bin/vm_stat": text})
    assert macos.wired_bytes(runner=runner, platform="darwin") == 456789 * 16384
    assert macos.wired_from_vm_stat("vm_stat: command not found") is None
    assert macos.wired_bytes() is None  # Linux


# -- jetsam -----------------------------------------------------------------------------


def test_the_jetsam_report_names_the_kill():
    kill = macos.jetsam_kill_in(JETSAM.read_text(), 41733, str(JETSAM))
    assert kill.reason == "vm-compressor-space-shortage" and kill.name == "python3.12"
    assert kill.largest_process == "python3.12"
    assert kill.resident_bytes == 1687552 * 16384
    assert kill.timestamp == "2026-05-15 22:03:57.00 +0800"
    assert "killed by jetsam (vm-compressor-space-shortage)" in kill.describe()
    other = macos.jetsam_kill_in(JETSAM.read_text(), 2527)
    assert other.reason == "highwater" and other.name == "wifianalyticsd"


def test_a_process_listed_but_not_killed_is_no_kill():
    assert macos.jetsam_kill_in(JETSAM.read_text(), 41790) is None  # the watchdog itself
    assert macos.jetsam_kill_in(JETSAM.read_text(), 99999) is None
    assert macos.jetsam_kill_in("not an ips file", 41733) is None
    crash = '{"bug_type":"309"}\n' + JETSAM.read_text().partition("\n")[2]
    assert macos.jetsam_kill_in(crash, 41733) is None  # another kind of report


def test_find_jetsam_reads_the_newest_reports_only(tmp_path):
    newer = tmp_path / "JetsamEvent-2026-05-16-080000.ips"
    newer.write_text('{"bug_type":"298","timestamp":"2026-05-16 08:00:00.00 +0800"}\n'
                     '{"largestProcess":"kernel_task","processes":[]}')
    shutil.copy(JETSAM, tmp_path / JETSAM.name)
    (tmp_path / "JetsamEvent-2026-05-14-000000.ips").write_text("garbage")
    os.utime(tmp_path / JETSAM.name, (1000, 1000))
    os.utime(newer, (2000, 2000))
    os.utime(tmp_path / "JetsamEvent-2026-05-14-000000.ips", (500, 500))
    assert macos.find_jetsam(41733, folder=tmp_path).reason == "vm-compressor-space-shortage"
    assert macos.find_jetsam(41733, folder=tmp_path, since=1500) is None  # older than the server
    assert macos.find_jetsam(41733, folder=tmp_path, newest=1) is None
    assert macos.find_jetsam(41733, folder=tmp_path / "missing") is None


def test_find_jetsam_does_not_block_on_a_planted_fifo(tmp_path):
    os.mkfifo(tmp_path / "JetsamEvent-2026-05-17-000000.ips")
    os.symlink(JETSAM, tmp_path / "JetsamEvent-2026-05-18-000000.ips")
    found = []
    worker = threading.Thread(target=lambda: found.append(
        macos.find_jetsam(41733, folder=tmp_path)), daemon=True)
    worker.start()
    worker.join(30)
    assert found == [None]  # neither the FIFO nor the link was read


# -- pmset -g ---------------------------------------------------------------------------


def test_pmset_on_a_laptop_that_sleeps():
    sections = macos.parse_pmset((DATA / "pmset-g-laptop.txt").read_text())
    settings = sections["Currently in use"]
    assert sections["System-wide power settings"] == {"SleepDisabled": "0"}
    assert settings["sleep"] == "1"
    assert settings["sleep note"] == "sleep prevented by bluetoothd, coreaudiod"
    assert settings["hibernatefile"] == "/var/vm/sleepimage" and settings["womp"] == "1"
    (problem,) = macos.sleep_problems(sections)
    assert problem.startswith("pmset: sleep 1: the Mac sleeps after 1 idle minute(s)")
    assert "now held off: sleep prevented by bluetoothd" in problem
    assert "caffeinate -i -s" in problem and "sudo pmset -a sleep 0" in problem


def test_pmset_on_a_desktop_that_never_sleeps_but_saves_power():
    sections = macos.parse_pmset((DATA / "pmset-g-studio.txt").read_text())
    assert sections["Currently in use"]["Sleep On Power Button"] == "1"
    assert macos.sleep_problems(sections) == [
        "pmset: lowpowermode 1: Low Power Mode slows generation; `sudo pmset -a lowpowermode 0`"]


def test_pmset_with_sleep_disabled_system_wide():
    sections = macos.parse_pmset((DATA / "pmset-g-disablesleep.txt").read_text())
    assert sections["Currently in use"]["sleep"] == "10"
    assert macos.sleep_problems(sections) == []


def test_pmset_falls_back_on_linux():
    assert macos.pmset_settings() == {}
    runner = fake_runner({"/usr/bin/pmset -g": (DATA / "pmset-g-laptop.txt").read_text()})
    assert macos.pmset_settings(runner=runner, platform="darwin")["Currently in use"]["sleep"] == "1"
