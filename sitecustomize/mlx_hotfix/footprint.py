"""A process's memory as macOS counts it: proc_pid_rusage(pid, RUSAGE_INFO_V4).

``phys_footprint`` is the number jetsam and Activity Monitor's "Memory"
column use; on Apple silicon it includes the GPU (IOAccelerator) memory a
process holds, which RSS leaves out, so RSS under-reports an MLX server.

Layout: ``struct rusage_info_v4`` from <sys/resource.h> (Apple XNU,
bsd/sys/resource.h): 16 bytes ``ri_uuid``, then 35 ``uint64_t`` fields in the
order of ``V4_FIELDS`` below, 296 bytes in all; ``RUSAGE_INFO_V4`` is 4.
``int proc_pid_rusage(int pid, int flavor, rusage_info_t *buffer)`` is
declared in <libproc.h> and lives in libSystem; it works on another process
of the same user (or any, as root), and fails with EPERM otherwise.

Standalone and stdlib only (ctypes, loaded only when called on macOS): the
shim imports it, and the watchdog loads this file by path (as it loads
pairings.py) to read the server's footprint itself. On any other system, or
when the call fails, ``read`` returns None: a missing value, never 0.
"""

import sys

RUSAGE_INFO_V4 = 4
V4_FIELDS = (
    "ri_user_time", "ri_system_time", "ri_pkg_idle_wkups", "ri_interrupt_wkups",
    "ri_pageins", "ri_wired_size", "ri_resident_size", "ri_phys_footprint",
    "ri_proc_start_abstime", "ri_proc_exit_abstime", "ri_child_user_time",
    "ri_child_system_time", "ri_child_pkg_idle_wkups", "ri_child_interrupt_wkups",
    "ri_child_pageins", "ri_child_elapsed_abstime", "ri_diskio_bytesread",
    "ri_diskio_byteswritten", "ri_cpu_time_qos_default", "ri_cpu_time_qos_maintenance",
    "ri_cpu_time_qos_background", "ri_cpu_time_qos_utility", "ri_cpu_time_qos_legacy",
    "ri_cpu_time_qos_user_initiated", "ri_cpu_time_qos_user_interactive",
    "ri_billed_system_time", "ri_serviced_system_time", "ri_logical_writes",
    "ri_lifetime_max_phys_footprint", "ri_instructions", "ri_cycles", "ri_billed_energy",
    "ri_serviced_energy", "ri_interval_max_phys_footprint", "ri_runnable_time",
)
# What read() returns, by the names the heartbeat and the watchdog use.
REPORTED = (("phys_footprint", "ri_phys_footprint"), ("resident_size", "ri_resident_size"),
            ("wired_size", "ri_wired_size"),
            ("lifetime_max_phys_footprint", "ri_lifetime_max_phys_footprint"))
LIBSYSTEM = "/usr/lib/libSystem.B.dylib"

_struct = None
_call = None  # proc_pid_rusage, or False where it cannot be had


def rusage_struct():
    """The ctypes Structure for rusage_info_v4 (built once)."""
    global _struct
    if _struct is None:
        import ctypes

        class RusageInfoV4(ctypes.Structure):
            _fields_ = [("ri_uuid", ctypes.c_uint8 * 16)] + [
                (name, ctypes.c_uint64) for name in V4_FIELDS]

        _struct = RusageInfoV4
    return _struct


def decode(raw):
    """{name: bytes} from the raw bytes of one rusage_info_v4 (see REPORTED)."""
    import ctypes

    struct = rusage_struct()
    info = struct.from_buffer_copy(bytes(raw)[:ctypes.sizeof(struct)])
    return {name: int(getattr(info, field)) for name, field in REPORTED}


def _proc_pid_rusage():
    global _call
    if _call is None:
        _call = False
        if sys.platform == "darwin":
            try:
                import ctypes

                function = ctypes.CDLL(LIBSYSTEM, use_errno=True).proc_pid_rusage
                function.argtypes = (ctypes.c_int, ctypes.c_int,
                                     ctypes.POINTER(rusage_struct()))
                function.restype = ctypes.c_int
                _call = function
            except (OSError, AttributeError):
                pass
    return _call or None


def read(pid):
    """{"phys_footprint", "resident_size", "wired_size", "lifetime_max_phys_footprint"}
    in bytes for process pid, or None (not macOS, no such process, not ours)."""
    call = _proc_pid_rusage()
    if call is None:
        return None
    import ctypes

    info = rusage_struct()()
    try:
        if call(int(pid), RUSAGE_INFO_V4, ctypes.byref(info)) != 0:
            return None
    except (OSError, ValueError, OverflowError):
        return None
    return decode(bytes(info))
