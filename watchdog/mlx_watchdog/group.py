"""Distributed groups: an `mlx.launch` command supervised as one server.

`mlx.launch [options] [--] CMD...` starts CMD once per rank (MLX_RANK=N),
on this machine for host 127.0.0.1 and through `ssh -tt HOST` for any other
name; rank 0 answers HTTP. What we learnt from its code (mlx 0.31/0.32,
mlx/_distributed_utils/launch.py) and rely on here:

- Local ranks inherit the launcher's environment, so PYTHONPATH (the shim)
  and MLX_HOTFIX_HEARTBEAT_FILE reach them as they are. Remote ranks get only
  `--env K=V` (and the hostfile's "envs"): the shim's path on those hosts is
  passed that way. But `--env` is exported on every rank, local ones too:
  the PYTHONPATH passed keeps this machine's after the remote shim's path.
- When a rank exits non-zero the launcher terminates the others, logs
  "Node with rank N exited with code C", and then itself exits **0**. A
  service manager that restarts on failure never restarts such a group, so
  `run_group` (under `mlx-watchdog exec`) turns any exit it did not ask for
  into a failure (70 when the launcher said 0).
- SIGTERM kills the launcher at once (it installs no handler) and leaves the
  ranks running. Every rank and every `ssh -tt` client is in the launcher's
  process group, so the group is stopped with killpg: local ranks die, and a
  remote rank loses its pty, whose hangup (SIGHUP) ends it.

Per-rank evidence: rank N>0 writes its heartbeat to `<file>.rankN` (the
shim's mlx_hotfix.group). `GroupHeartbeat` reads every rank's file present
here and hands the judge the worst one, so a rank that hangs, or that waits
in a collective for a rank that hangs, is a hang of the group, not a busy
server. Remote ranks' files stay on their hosts; their hang shows here as
rank 0 stalling in the next collective.

This module runs a group (`prepare`, `run_group`); the other jobs have their
own: group_launch.py (the launch line), group_hosts.py (hostfiles, this
machine's names), group_ssh.py (reachability), group_heartbeats.py (every
rank's heartbeat), group_install.py (`install --hostfile/--hosts`).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence

from . import contract, defaults
from .group_heartbeats import clear_heartbeats
from .group_launch import LaunchCommand, localized, parse_launch

GROUP_FAILED_EXIT = defaults.SHIM_EXIT_CODE
REMOTE_SHIM_ENV = "MLX_WATCHDOG_REMOTE_SHIM"


def prepare(argv: Sequence[str], env: Dict[str, str], *, private_dir: "str | os.PathLike[str]",
            remote_shim_path: Optional[str] = None, shim: bool = True
            ) -> Optional[LaunchCommand]:
    """For supervise and exec: the group command as it should run, or None if
    argv is not mlx.launch. Local host names in the hostfile become 127.0.0.1;
    remote ranks get the shim (`--env PYTHONPATH=`, at remote_shim_path, by
    default the same path as here, followed by this machine's PYTHONPATH for
    the local ranks) and the shim's settings.
    GroupError when it cannot run."""
    command = parse_launch(argv)
    if command is None:
        return None
    command = localized(command, private_dir)
    if not command.remote_hosts:
        return command
    # The shim's settings, but not the heartbeat file nor the report folder:
    # their folders are on this host (a remote rank writes its reports into
    # its own host's default folder). What the command itself passes with
    # --env stands (it comes first: ours would win), but the shim goes in
    # front of its PYTHONPATH.
    own = command.launch_env()
    local_only = (defaults.HEARTBEAT_ENV, defaults.REPORT_DIR_ENV)
    forwarded = {k: v for k, v in env.items()
                 if ((k.startswith(contract.ENV_PREFIX) and k not in local_only)
                     or k == "HF_HUB_OFFLINE") and k not in own}
    if not shim:
        return command.with_env(forwarded)
    shim_folder = remote_shim_path or env.get(REMOTE_SHIM_ENV)
    if shim_folder is None:
        from .shim import shim_dir

        try:
            shim_folder = str(shim_dir())
        except FileNotFoundError:
            shim_folder = None
    if shim_folder:
        # mlx.launch exports --env for every rank, local ones too: so this
        # PYTHONPATH ends with this machine's own (its shim first), which a
        # local rank would otherwise lose. A folder missing on a host is
        # skipped there; the first shim found runs.
        entries = [shim_folder, *own.get("PYTHONPATH", "").split(":"),
                   *env.get("PYTHONPATH", "").split(os.pathsep)]
        path = ":".join(dict.fromkeys(e for e in entries if e))  # ':' on macOS and Linux
        forwarded = {"PYTHONPATH": path, **forwarded}
    return command.with_env(forwarded)


def run_group(argv: Sequence[str], env: Mapping[str, str], *,
              stop_grace_s: float = defaults.STOP_GRACE_S,
              out=sys.stderr) -> int:
    """Run an mlx.launch group until it ends; the status a service manager should see.

    The launcher runs in its own process group. SIGTERM, SIGINT or SIGHUP to
    us stops that whole group (every local rank, every ssh client), SIGKILL
    after stop_grace_s; then we exit 0. An end we did not ask for is a
    failure: mlx.launch exits 0 after a rank died, so that becomes 70.
    """
    heartbeat = env.get(defaults.HEARTBEAT_ENV)
    if heartbeat:
        clear_heartbeats(heartbeat)
    try:
        launcher = subprocess.Popen(list(argv), env=dict(env), start_new_session=True)
    except OSError as exc:
        print(f"mlx-watchdog: cannot run {argv[0]!r}: {exc.strerror or exc}", file=out)
        return 127
    asked: List[int] = []

    def stop(signum, _frame):
        asked.append(signum)
        _signal_group(launcher.pid, signal.SIGTERM)

    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, stop) for sig in handled}
    try:
        while True:
            try:
                code = launcher.wait(timeout=0.5 if not asked else stop_grace_s)
                break
            except subprocess.TimeoutExpired:
                if asked:
                    _signal_group(launcher.pid, signal.SIGKILL)
    finally:
        # Nothing of the group outlives it: a rank the launcher left behind
        # (it leaves them all when it is killed) goes with it.
        _signal_group(launcher.pid, signal.SIGTERM)
        for _ in range(int(min(stop_grace_s, 5.0) / 0.1)):
            if not _group_alive(launcher.pid):
                break
            time.sleep(0.1)
        _signal_group(launcher.pid, signal.SIGKILL)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if asked:
        return 0
    if code == 0:
        print(f"mlx-watchdog: mlx.launch exited 0, but a serving group never ends by itself "
              f"(a rank died: see 'Node with rank N exited' above); exiting "
              f"{GROUP_FAILED_EXIT} so the service manager restarts the group", file=out)
        return GROUP_FAILED_EXIT
    return code if code > 0 else 128 - code


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
        if sig != signal.SIGKILL:
            os.killpg(pgid, signal.SIGCONT)


def _group_alive(pgid: int) -> bool:
    """A live (not zombie) process is left in the group. Zombies do not count:
    they are dead, and an init that does not reap would keep them forever."""
    import psutil

    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return False
