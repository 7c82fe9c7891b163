"""The watchdog's tunable defaults and the names it shares with the shim.

The CLI, the config file and the library classes read these from here, so
`mlx-watchdog supervise --help`, a watch config and the docs agree. Paths
that depend on the platform (the state file, the report folder) are computed
where they are used (state.py, reports.py); the shim keeps its own defaults
(sitecustomize/mlx_hotfix/config.py). The names shared with the shim come
from its contract module (contract.py).
"""

from . import contract

URL = "http://127.0.0.1:8080"
HOST = "127.0.0.1"  # mlx_lm.server's own default --host
PORT = 8080  # mlx_lm.server's own default --port
MODEL = "default_model"  # what mlx_lm.server calls the model given with --model

# Probing
PROBE_INTERVAL_S = 5.0
PROBE_TIMEOUT_S = 10.0  # total, for /health plus the completion
MAX_BODY_BYTES = 1 << 20
# GET /health before the completion. Off: mlx-lm answers the completion itself
# with 404 "generation thread died" once that thread is gone (0.32), and its
# /health says 200 regardless (0.31); on, it costs a second request per probe.
CHECK_HEALTH = False

# Judging
FAILURES = 3  # consecutive failed probes (without progress) before acting
BOOT_GRACE_S = 60.0  # after each (re)start, failures do not count
# A heartbeat older than this is stale, and one failed probe then means wedged.
# The loop beats ~10x/s idle and once per decode step busy: raise it for huge
# models whose single prefill step takes longer (a model load reads as loading).
HEARTBEAT_TIMEOUT_S = 10.0
CPU_BUSY_FRACTION = 0.05  # 5% of one core over the interval counts as progress
MAX_BUSY_S = 600.0  # busy without any successful probe for this long => wedged

# Restarting
# SIGTERM, then SIGKILL after this long. Generous on purpose: a SIGKILLed
# process holding a large wired model on macOS has been reported to leak the
# wired memory until reboot, while SIGTERM released it (jundot/omlx #2184).
STOP_GRACE_S = 30.0
# A planned restart (`mlx-watchdog restart`) sends SIGTERM and waits this
# long for the shim's drain (MLX_HOTFIX_DRAIN_TIMEOUT, the shim's default)
# plus a margin, then goes on as a normal stop (SIGTERM again, the grace, SIGKILL).
DRAIN_TIMEOUT_S = 25.0
DRAIN_TIMEOUT_ENV = contract.DRAIN_TIMEOUT_ENV  # read by the hotfix shim
DRAIN_MARGIN_S = 5.0
STACKS_WAIT_S = 2.0  # after SIGUSR1, wait this long for the server's stacks file
ACTION_TIMEOUT_S = 60.0  # launchctl / systemctl / a restart command
BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 60.0  # restarts are never paused longer than this
MAX_RESTARTS = 5  # this many per window is shown as crash-looping (restarts go on)
RESTART_WINDOW_S = 300.0

# The memory guard (memory.py, memory_judge.py): off unless a limit is known.
# "auto": on macOS the smaller of RAM minus a reserve and the GPU wired cap;
# elsewhere off. A planned restart when the hard line (95% of the limit) is
# crossed, or the trend says it will be within the horizon, taken at the
# first moment with nothing in flight within the idle wait, else at once.
MEMORY_LIMIT = "auto"
MEMORY_HORIZON_S = 6 * 3600.0
MEMORY_IDLE_WAIT_S = 300.0

# Daemon
METRICS_HOST = "127.0.0.1"
LOG_FORMAT = "text"
API_KEY_ENV = "MLX_WATCHDOG_API_KEY"
HEARTBEAT_ENV = contract.HEARTBEAT_FILE_ENV  # read by the hotfix shim
# Sent with every probe request (value "1"): the shim keeps such requests out
# of the server's log and throughput counters (patches/heartbeat.py), and its
# admission part never refuses one nor queues it behind waiting clients.
PROBE_HEADER = "X-MLX-Watchdog-Probe"
BUSY_ERROR_TYPE = "server_busy"  # the shim's 503 when it sheds load (admission)
SHIM_EXIT_CODE = contract.EXIT_CODE  # the hotfix shim exits with this when the generation thread dies
REPORT_DIR_ENV = contract.REPORT_DIR_ENV  # crash reports; read by the shim too
# The instance's name, for the shim's crash reports (several instances share a
# report folder); supervise and install set it.
INSTANCE_ENV = contract.INSTANCE_ENV

# Installing
MANAGERS = ("launchd", "systemd")  # the service managers `install` writes for
LAUNCHD_DOMAIN = "gui/{uid}"  # a LaunchAgent's domain: LAUNCHD_DOMAIN.format(uid=...)
