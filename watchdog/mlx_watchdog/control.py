"""Requests to a running daemon (`watch` or `supervise`) from the command
line: `mlx-watchdog restart NAME` asks for a planned restart.

A request is a small JSON file in the daemon's control folder,
`<state file>.control/` (next to the state file it writes, which is how
`status` finds a daemon too). Each daemon polls that folder twice a second
from one light thread (a listing of a folder that is nearly always empty).

    CLI     writes   restart-<id>.request.json   (atomically: a temporary file, then rename)
    daemon  renames  it to restart-<id>.taken     (the claim: one daemon takes it)
            hands it to the instance's monitor, which restarts between two ticks
            writes   restart-<id>.done.json      ({"ok": ..., "detail": ...})
    CLI     reads and removes the answer

Several daemons may share a state file (and so the folder): each takes only
the requests for instances it runs. A request nobody takes is removed by its
CLI after a few seconds; one left behind (a CLI killed meanwhile) is dropped
by the daemons once older than STALE_S, so it cannot fire much later.

Who may ask: the daemon makes the folder itself, mode 0700, and refuses to
use one that is a link, belongs to another user or is open to others. It
takes only regular files (opened without following links and without
blocking: safefile.open_regular) owned by its own user or root. So only the
daemon's user (or root) can restart its servers, as they could with a signal.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional

from .act import ActionResult
from .log import Events
from .safefile import NotARegularFile, open_regular, write_atomically

POLL_S = 0.5
STALE_S = 60.0
REQUEST = ".request.json"
TAKEN = ".taken"
DONE = ".done.json"
_ID = re.compile(r"restart-[A-Za-z0-9]{8,64}\Z")


class ControlError(Exception):
    """The control folder cannot be used; the message says why and what to do."""


def control_dir(state_path: "str | os.PathLike[str]") -> Path:
    return Path(f"{os.fspath(state_path)}.control")


def _owners() -> tuple:
    return (os.geteuid(), 0)


def check_folder(folder: Path, *, create: bool) -> None:
    """ControlError unless folder is a private directory of ours (made when create)."""
    if create:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ControlError(f"cannot make the control folder {folder}: "
                               f"{exc.strerror or exc}") from None
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        raise ControlError(f"no control folder at {folder}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ControlError(f"{folder} is not a directory (a link?); remove it")
    if st.st_uid != os.geteuid() and os.geteuid() != 0:
        raise ControlError(f"{folder} belongs to uid {st.st_uid}, not to you (uid "
                           f"{os.geteuid()}): run this as that user")
    if create and st.st_uid != os.geteuid():
        raise ControlError(f"{folder} belongs to uid {st.st_uid}, not to this daemon: "
                           "remove it so that the daemon makes its own")
    if create and st.st_mode & 0o077:
        os.chmod(folder, 0o700)  # ours: close it to others


def _read(path: Path) -> Optional[Dict[str, Any]]:
    """A request file's content, if it is a regular file of ours; else None."""
    try:
        fd = open_regular(path)
    except (NotARegularFile, OSError):
        return None
    with os.fdopen(fd, "rb") as handle:
        if os.fstat(handle.fileno()).st_uid not in _owners():
            return None
        try:
            data = json.loads(handle.read(65536))
        except ValueError:
            return {}
    return data if isinstance(data, dict) else {}


class ControlPoller:
    """The daemon's side: takes restart requests for its monitors.

    monitors: name -> monitor (monitor.Monitor: request_planned_restart)."""

    def __init__(self, folder: Path, monitors: Mapping[str, Any],
                 events: Optional[Events] = None, clock: Callable[[], float] = time.time):
        self.folder = Path(folder)
        self.monitors = monitors
        self.events = events or Events()
        self.clock = clock
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.problem: Optional[str] = None

    def start(self) -> None:
        try:
            check_folder(self.folder, create=True)
        except ControlError as exc:
            self.problem = str(exc)
            self.events.warning("control", f"`mlx-watchdog restart` will not reach this "
                                           f"daemon: {exc}")
            return
        self._thread = threading.Thread(target=self._run, name="mlx-watchdog-control",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the poller outlives any one bad request
                self.events.exception("control", "reading the control folder failed")

    def poll(self) -> None:
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for name in names:
            if name.endswith(REQUEST) and _ID.match(name[: -len(REQUEST)]):
                self._consider(name[: -len(REQUEST)])

    def _consider(self, request_id: str) -> None:
        path = self.folder / (request_id + REQUEST)
        data = _read(path)
        if data is None:
            return  # not ours to read: someone else's file, or gone
        instance = data.get("instance")
        if not isinstance(instance, str) or instance not in self.monitors:
            self._drop_if_stale(path)  # another daemon's, or nobody's
            return
        taken = self.folder / (request_id + TAKEN)
        try:
            os.rename(path, taken)  # the claim
        except OSError:
            return  # another daemon took it
        if data.get("action") != "restart":
            self._answer(request_id, taken, ActionResult(
                False, f"unknown action {str(data.get('action'))[:40]!r}"))
            return
        asked = data.get("reason")
        reason = asked if isinstance(asked, str) and asked else "asked with mlx-watchdog restart"
        self.monitors[instance].request_planned_restart(
            reason[:200], done=lambda result: self._answer(request_id, taken, result))

    def _drop_if_stale(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            if self.clock() - path.stat().st_mtime > STALE_S:
                path.unlink()

    def _answer(self, request_id: str, taken: Path, result: ActionResult) -> None:
        try:
            write_atomically(self.folder / (request_id + DONE),
                             json.dumps({"ok": result.ok, "detail": result.detail,
                                         "time": self.clock()}) + "\n")
        except OSError as exc:
            self.events.warning("control", f"cannot answer {request_id}: {exc.strerror or exc}")
        with contextlib.suppress(OSError):
            taken.unlink()


# -- the command line's side ---------------------------------------------------------


class Request:
    """One restart request, as the CLI sends it and waits for its answer."""

    def __init__(self, folder: Path, instance: str, reason: str):
        check_folder(folder, create=False)
        self.folder = folder
        self.id = "restart-" + secrets.token_hex(8)
        self.path = folder / (self.id + REQUEST)
        write_atomically(self.path, json.dumps({
            "action": "restart", "instance": instance, "reason": reason,
            "time": time.time(), "pid": os.getpid()}) + "\n")

    def taken(self) -> bool:
        return not self.path.exists()

    def answer(self) -> Optional[Dict[str, Any]]:
        """The daemon's answer once written ({"ok", "detail", "time"}); removes it."""
        done = self.folder / (self.id + DONE)
        data = _read(done)
        if data is None:
            return None
        with contextlib.suppress(OSError):
            done.unlink()
        return data

    def withdraw(self) -> bool:
        """Take the request back; False if a daemon took it meanwhile."""
        try:
            self.path.unlink()
            return True
        except FileNotFoundError:
            return False
