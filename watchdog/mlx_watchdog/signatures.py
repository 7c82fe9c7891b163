"""The death classes, for the watchdog: the shim's table of signatures
(sitecustomize/mlx_hotfix/signatures.py), loaded once by path as data (the
watchdog never imports mlx_hotfix as a package), and what the watchdog adds
around it: a class for an exit that left no report, the rank and host of a
group failure, and the table in docs/operator.md.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Iterable, Mapping, Optional, Sequence

from .shim import shim_dir

SIGKILL = 9
SIGABRT = 6


@functools.lru_cache(maxsize=1)
def table() -> Any:
    """The shim's signatures module (loaded once)."""
    path = shim_dir() / "mlx_hotfix" / "signatures.py"
    spec = importlib.util.spec_from_file_location("mlx_watchdog_signatures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def classify(type_name: Optional[str], message: Optional[str],
             traceback: Optional[str] = None) -> Any:
    """The class of an exception (a Match; class ``unknown`` when none fits)."""
    return table().classify(type_name, message, traceback)


def classify_text(text: Optional[str]) -> Any:
    """The class of a death from the text it left (stderr, a fatal-stacks file,
    a crash, panic or jetsam report)."""
    return table().classify_text(text)


def entry(cls: Optional[str]) -> Any:
    """The table entry of a class name (the ``unknown`` entry for any other)."""
    return table().entry(cls)


def restart_cannot_fix(cls: Optional[str]) -> bool:
    """A known class that fails the same way after every restart."""
    sig = entry(cls)
    return sig.cls != table().UNKNOWN and not sig.restart_helps


def killed_by(returncode: Optional[int]) -> Optional[int]:
    """The signal that ended a process, from its return code (-9 from
    subprocess, 137 from a shell or launchd), else None."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    if 128 < returncode < 160:
        return returncode - 128
    return None


def classify_exit(returncode: Optional[int], *, texts: Iterable[Optional[str]] = (),
                  oom: Optional[Mapping[str, Any]] = None) -> Any:
    """The class of an exit that left no crash report of its own.

    texts: what it left elsewhere (the tail of its stderr, a fatal-stacks
    file, a jetsam or panic report), newest evidence first; the first one
    with a known class wins. Else a SIGKILL is ``killed``, with the kernel's
    OOM-killer record when one was found (oomkill.find_oom_kill(pid)).
    """
    module = table()
    signal = killed_by(returncode)
    for text in texts:
        match = module.classify_text(text)
        if match.known:
            match.detail.setdefault("exit_code", returncode)
            return match
    detail: dict = {"exit_code": returncode}
    if signal is not None:
        detail["signal"] = signal
    if signal == SIGKILL:
        if oom:
            detail.update(oom)
        return module.Match(module.entry("killed"), detail)
    return module.Match(module.UNKNOWN_ENTRY, detail)


def cause_of_exit(returncode: Optional[int], death: Optional[Mapping[str, Any]] = None, *,
                  pid: Optional[int] = None, output: Optional[str] = None,
                  find_oom: Optional[Any] = None,
                  hosts: Optional[Sequence[str]] = None) -> Any:
    """The class of a supervised child's exit, from the best evidence there is:
    the shim's own word (the heartbeat's ``death``: its ``cause``, else its
    summary), then the tail of the child's output, then how it ended (a
    SIGKILL is ``killed``, with the kernel's OOM-killer record of pid where
    the kernel's log can be read: find_oom(pid), oomkill.find_oom_kill by
    default). hosts: a group's hosts in rank order (an mlx.launch child):
    a group class then names the rank and host that failed, from the
    survivors' lines in output (group_failure). Never raises."""
    module = table()
    try:
        if hosts is not None and output:
            match = group_failure(output, hosts)
            if match.entry.group:
                match.detail.setdefault("exit_code", returncode)
                return match
        texts = []
        if death:
            cause = death.get("cause")
            if isinstance(cause, str) and cause in module.BY_CLASS and cause != module.UNKNOWN:
                return module.Match(module.entry(cause), {"exit_code": returncode})
            texts.append(death.get("summary"))
        texts.append(output)
        oom = None
        if killed_by(returncode) == SIGKILL and pid:
            if find_oom is None:
                from .oomkill import find_oom_kill as find_oom
            found = find_oom(pid)
            oom = found.as_detail() if found is not None else None
        return classify_exit(returncode, texts=[t for t in texts if t], oom=oom)
    except Exception:  # noqa: BLE001 - a class is evidence, never a new failure
        return module.Match(module.UNKNOWN_ENTRY, {"exit_code": returncode})


def jetsam_match(detail: dict) -> Any:
    """The class of a death macOS's jetsam report names (macos.find_jetsam)."""
    module = table()
    return module.Match(module.entry("jetsam"), detail)


def death_record(match: Any, **extra: Any) -> dict:
    """A death's class for the state file and status: cause, title, remedy,
    where it comes from, what is known."""
    sig = match.entry
    record = {"cause": match.cls, "title": sig.title, "remedy": sig.remedy,
              "restart_helps": sig.restart_helps, "source": sig.source,
              "detail": dict(match.detail)}
    record.update(extra)
    return record


def group_failure(text: Optional[str], hosts: Sequence[str] = ()) -> Any:
    """The class of a group's failure from its combined output, with the rank
    (and, given the hostfile's hosts in rank order, the host) that failed.

    The failed rank is the one mlx.launch named first ("Node with rank N
    exited with code C"), else, when every other rank's own line reports the
    peer lost, the one rank that did not.
    """
    module = table()
    match = module.classify_text(text)
    if not match.entry.group:
        return match
    detail = match.detail
    seen = module.reporters(text, match.entry)
    if seen:
        detail["reported_by"] = sorted(seen)
        if "host" not in detail:
            first = min(seen)
            detail.setdefault("rank", first)
            detail["host"] = seen[first]
    if "failed_rank" not in detail and hosts:
        silent = [rank for rank in range(len(hosts)) if rank not in seen]
        if seen and len(silent) == 1:
            detail["failed_rank"] = silent[0]
    failed = detail.get("failed_rank")
    if isinstance(failed, int) and 0 <= failed < len(hosts):
        detail["failed_host"] = hosts[failed]
    return match


def restart_column(sig: Any) -> str:
    if not sig.restart_helps:
        return "no: same failure every time" if sig.config else "no"
    if sig.group:
        return "yes, the whole group"
    if sig.gpu_fault:
        return "yes, a new process only"
    return "yes"


def markdown_table() -> str:
    """The table of death classes in docs/operator.md, made from the table itself."""
    module = table()
    rows = ["| class | what happened | a restart helps | remedy |",
            "|---|---|---|---|"]
    for sig in module.TABLE + (module.UNKNOWN_ENTRY,):
        rows.append(f"| `{sig.cls}` | {_markdown(sig.title)} | {restart_column(sig)} "
                    f"| {_markdown(sig.remedy)} |")
    return "\n".join(rows) + "\n"


def _markdown(text: str) -> str:
    """Plain text, safe in a markdown table cell (no tags, emphasis or cell breaks)."""
    for char in "\\|*<>":
        text = text.replace(char, "\\" + char)
    return text
