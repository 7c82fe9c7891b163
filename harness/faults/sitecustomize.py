"""Test-only fault injection into the stock mlx_lm.server, via PYTHONPATH.

Put this folder on PYTHONPATH after the shim's (the shim chains into it) or
alone (stock, no shim). MLX_TEST_FAULT selects one fault:

    raise:<kind>:<where>[:<after>]   raise on the (after+1)-th call of <where>
    hang:<where>[:<after>]           block forever there, at 0% CPU
    spin:<where>[:<after>]           loop forever there, burning CPU
    hold:<where>[:<after>]           wait there (0% CPU) until MLX_TEST_FAULT_RELEASE_FILE
                                     exists, then carry on: a slow model load, say
    livelock:batch[:<after>]         BatchGenerator.next returns no responses,
                                     forever: the loop turns, nothing is
                                     delivered (upstream #1493)
    chaos:<where>                    the fault is chosen at run time, once per
                                     arming: the first call after
                                     MLX_TEST_FAULT_ARM_FILE appears reads its
                                     first line (raise:<kind>, hang, spin or
                                     livelock), removes the file and strikes
                                     (bench/chaos_soak.py)

<where>: load (ModelProvider.load_default), prefill (PromptProcessingBatch.prompt),
decode (GenerationBatch.next), extract_cache (BatchGenerator.extract_cache),
step or batch (BatchGenerator.next: every threaded release, 0.28.4 on).
<kind>: typeerror, resource, slice, broadcast, extract (the death modes users
reported upstream, with their real messages); gputimeout, penaltybox,
invalidresource, metaloom (the Metal errors mlx 0.32 raises as RuntimeError);
ringlost (a ring peer lost, mlx 0.32.1+); quoted: a ValueError whose text is
MLX_TEST_FAULT_MESSAGE (an exception that quotes request content); or armed:
the kind written in the arm file, read when the fault strikes, so one server
can die of several (write the arm file whole, then rename it into place:
tests/conftest.py arm_fault).

MLX_TEST_FAULT_RANK=N injects the fault only in the process whose MLX_RANK
(set by mlx.launch for each rank of a distributed group) is N.

Fault counting starts only after MLX_TEST_FAULT_ARM_FILE exists, when that is
set, so a test can warm the server up first.

The arm file may name the fault itself: a spec in it (say ``hang:decode``)
replaces MLX_TEST_FAULT's action when it strikes, at the same <where>, so
one server (or group) can be struck by a death, then a hang.

MLX_TEST_IGNORE_SIGTERM=<file> (a rank blocked in native code, upstream mlx
#3910): SIGTERM is ignored, and SIGHUP kills as by default; each arrival
appends one line ``<SIGNAL> pid=<pid> t=<time>`` to <file>, so a test can
tell which signal reached the process. Honours MLX_TEST_FAULT_RANK.

MLX_TEST_FAULT_ONESHOT=1 makes a fault strike once per arming: it removes
the arm file and starts counting afresh (a test arms it again for the next).

MLX_TEST_SHIM_FAULT selects one fault on the shim's own path (which must
never fail):

    reaper-start   the exit part's reaper thread cannot start (threading.Thread
                   .start raises "can't start new thread" for mlx-hotfix-exit)
    plan           the recover part's plan raises (with MLX_HOTFIX_RECOVER=thread)
    stop-once      GenerationContext.stop raises once, on the disconnect watcher
                   thread (the first client it sees hang up)

MLX_TEST_LEAK_BYTES=N (the memory guard's tests): every completion request
(not the watchdog's probes, which carry X-MLX-Watchdog-Probe) keeps N bytes,
written so they are resident, for the life of the process: a server that
leaks memory per request, as upstream #1118 reports.

Traces, independent of any fault:
    MLX_TEST_TRACE_LOADS=1       one stderr line ``mlx-test-trace: model load``
                                 per ModelProvider._load (a real load from disk)
    MLX_TEST_DECODE_COUNT_FILE=P the number of GenerationBatch.next calls so far
                                 (decode steps), rewritten on each call
    MLX_TEST_DEATH_STAMP=1       (bench) one stderr line ``bench-death: <Type>:
                                 <message> t=<time.time()>`` the first time an
                                 exception leaves BatchGenerator.next

Every fault and trace is a post-import hook in the shim's own registry
(``mlx_hotfix.when_imported``, see _shim_hooks), so it runs right after its
module executes and before any patch wraps the same code. With none of these
variables set, this file does nothing at all.

When a fault strikes it writes one line to stderr, just before it acts:
``mlx-test-fault: <action> at <where> t=<time.time()>`` (the wall-clock time,
for benchmarks that measure from the moment of death).
"""

import os
import sys
import time

_SPEC = os.environ.get("MLX_TEST_FAULT", "")

_MESSAGES = {
    "typeerror": (TypeError, "'NoneType' object is not iterable"),
    "resource": (RuntimeError, "[metal::malloc] Resource limit (499000) exceeded."),
    "slice": (ValueError, "Slice indices must be 32-bit integers."),
    "broadcast": (ValueError, "[broadcast_shapes] Shapes (1,8,1,16) and (1,8,1,0) cannot be broadcast."),
    "extract": (IndexError, "list index out of range (in extract_cache)"),
    # mlx backend/metal/device.cpp: "[METAL] Command buffer execution failed: {}.",
    # with Metal's own description of the error (see mlx_hotfix/signatures.py).
    "gputimeout": (RuntimeError, "[METAL] Command buffer execution failed: Caused GPU Timeout "
                   "Error (00000002:kIOGPUCommandBufferCallbackErrorTimeout)."),
    "penaltybox": (RuntimeError, "[METAL] Command buffer execution failed: Ignored (for causing "
                   "prior/excessive GPU errors) "
                   "(00000004:kIOGPUCommandBufferCallbackErrorSubmissionsIgnored)."),
    "invalidresource": (RuntimeError, "[METAL] Command buffer execution failed: Invalid Resource "
                        "(00000009:kIOGPUCommandBufferCallbackErrorInvalidResource)."),
    "metaloom": (RuntimeError, "[METAL] Command buffer execution failed: Insufficient Memory "
                 "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)."),
    "ringlost": (RuntimeError, "[ring] connection to a peer was lost"),
    "quoted": (ValueError, None),  # the text: MLX_TEST_FAULT_MESSAGE
}
_ARMED = "armed"  # the kind is the arm file's content

_TARGETS = {
    "load": ("mlx_lm.server", "ModelProvider", "load_default"),
    "prefill": ("mlx_lm.generate", "PromptProcessingBatch", "prompt"),
    "decode": ("mlx_lm.generate", "GenerationBatch", "next"),
    "extract_cache": ("mlx_lm.generate", "BatchGenerator", "extract_cache"),
    # One batched step, the same method in every threaded release (0.28.4+).
    "step": ("mlx_lm.generate", "BatchGenerator", "next"),
    "batch": ("mlx_lm.generate", "BatchGenerator", "next"),
}


def _parse(spec):
    parts = spec.split(":")
    action = parts[0]
    if action == "raise":
        kind, where = parts[1], parts[2]
        after = int(parts[3]) if len(parts) > 3 else 0
    elif action in ("hang", "spin", "hold", "livelock", "chaos"):
        kind, where = None, parts[1]
        after = int(parts[2]) if len(parts) > 2 else 0
    else:
        raise ValueError("MLX_TEST_FAULT: unknown action %r" % action)
    if where not in _TARGETS:
        raise ValueError("MLX_TEST_FAULT: unknown place %r" % where)
    if kind is not None and kind not in _MESSAGES and kind != _ARMED:
        raise ValueError("MLX_TEST_FAULT: unknown kind %r" % kind)
    if kind == _ARMED and not os.environ.get("MLX_TEST_FAULT_ARM_FILE"):
        raise ValueError("MLX_TEST_FAULT: kind armed needs MLX_TEST_FAULT_ARM_FILE")
    return action, kind, where, after


def _armed():
    arm_file = os.environ.get("MLX_TEST_FAULT_ARM_FILE")
    return not arm_file or os.path.exists(arm_file)


def _error(kind):
    """The exception to raise for kind; for "armed", the kind in the arm file."""
    if kind == _ARMED:
        with open(os.environ["MLX_TEST_FAULT_ARM_FILE"]) as handle:
            kind = handle.read().strip()
        if kind not in _MESSAGES:
            return ValueError("MLX_TEST_FAULT: the arm file names no kind (%r)" % kind)
    error, message = _MESSAGES[kind]
    return error(message or os.environ.get("MLX_TEST_FAULT_MESSAGE", ""))


def _strike(action, kind, where, error=None):
    """Announce the fault on stderr, then act it out (raise, block, spin).

    error: the exception to raise, worked out before a one-shot fault unarms
    (the "armed" kind reads its kind from the arm file)."""
    sys.stderr.write("mlx-test-fault: %s at %s t=%.6f\n" % (action, where, time.time()))
    sys.stderr.flush()
    if action == "raise":
        raise error if error is not None else _error(kind)
    if action == "hang":
        import threading

        threading.Event().wait()
    if action == "hold":
        release = os.environ.get("MLX_TEST_FAULT_RELEASE_FILE", "")
        while not (release and os.path.exists(release)):
            time.sleep(0.05)
    while action == "spin":
        pass


def _take_armed_fault():
    """chaos: (action, kind) from the arm file's first line, the file then
    removed; None while there is no arm file (or no line in it yet)."""
    arm_file = os.environ.get("MLX_TEST_FAULT_ARM_FILE", "")
    try:
        with open(arm_file) as handle:
            line = handle.readline().strip()
        if not line:
            return None  # still being written
        os.remove(arm_file)
    except OSError:
        return None
    parts = line.split(":")
    if parts[0] == "raise" and len(parts) == 2 and parts[1] in _MESSAGES:
        return "raise", parts[1]
    if parts[0] in ("hang", "spin", "livelock") and len(parts) == 1:
        return parts[0], None
    raise ValueError("MLX_TEST_FAULT=chaos: unknown fault %r in the arm file" % line)


def _inject_chaos(owner, name, where):
    original = getattr(owner, name)
    livelocked = [False]

    def chaotic(*args, **kwargs):
        if livelocked[0]:
            time.sleep(0.002)
            return [], []
        chosen = _take_armed_fault()
        if chosen is None:
            return original(*args, **kwargs)
        action, kind = chosen
        if action == "livelock":  # for good, in this process
            livelocked[0] = True
            sys.stderr.write("mlx-test-fault: livelock at %s t=%.6f\n" % (where, time.time()))
            sys.stderr.flush()
            return [], []
        _strike(action, kind, where)

    setattr(owner, name, chaotic)


def _armed_as(action, kind, where):
    """The action and kind to strike with: the arm file's spec, if it holds one.
    (With the kind "armed" the file holds a kind only: see _error.)"""
    if kind == _ARMED:
        return action, kind
    try:
        with open(os.environ["MLX_TEST_FAULT_ARM_FILE"]) as handle:
            spec = handle.read().strip()
    except (KeyError, OSError):
        spec = ""
    if ":" in spec:
        armed_action, armed_kind, armed_where, _ = _parse(spec)
        if armed_where == where:
            return armed_action, armed_kind
    return action, kind


def _inject(module, installed_action, installed_kind, where, after):
    owner = getattr(module, _TARGETS[where][1])
    name = _TARGETS[where][2]
    if installed_action == "chaos":
        return _inject_chaos(owner, name, where)
    original = getattr(owner, name)
    calls = [0]
    struck = [None]  # the action, once struck

    def faulty(*args, **kwargs):
        if struck[0] == "livelock":  # once struck, for good
            time.sleep(0.002)  # a real livelock spins; spare the shared CPU
            return [], []
        if _armed():
            calls[0] += 1
            if calls[0] > after:
                action, kind = _armed_as(installed_action, installed_kind, where)
                struck[0] = action
                error = _error(kind) if action == "raise" else None  # before a one-shot unarms
                if os.environ.get("MLX_TEST_FAULT_ONESHOT") == "1":
                    calls[0] = 0
                    try:
                        os.remove(os.environ["MLX_TEST_FAULT_ARM_FILE"])
                    except (KeyError, OSError):
                        pass
                if action == "livelock":
                    sys.stderr.write("mlx-test-fault: %s at %s t=%.6f\n" % (action, where, time.time()))
                    sys.stderr.flush()
                    return [], []
                _strike(action, kind, where, error)
        return original(*args, **kwargs)

    setattr(owner, name, faulty)


def _shim_hooks():
    """The shim's own post-import hooks (mlx_hotfix._hooks), installed.

    With the shim on PYTHONPATH this is the registry its patches use too: a
    fault registered here (at start-up, before the shim activates) runs
    right after the module executes and before the patches wrap it, as the
    shim would see a real failure. On stock control runs (no shim on the
    path) the package is loaded from the checkout's drop-in folder by file,
    without its sitecustomize: nothing activates a patch, and sys.path stays
    as stock has it.
    """
    try:
        import mlx_hotfix
    except ImportError:
        import importlib.util

        folder = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))), "sitecustomize", "mlx_hotfix")
        spec = importlib.util.spec_from_file_location(
            "mlx_hotfix", os.path.join(folder, "__init__.py"),
            submodule_search_locations=[folder])
        mlx_hotfix = importlib.util.module_from_spec(spec)
        sys.modules["mlx_hotfix"] = mlx_hotfix
        spec.loader.exec_module(mlx_hotfix)
    mlx_hotfix._hooks.install()
    return mlx_hotfix.when_imported


def _trace_loads(server):
    owner = server.ModelProvider
    original = owner._load

    def _load(*args, **kwargs):
        sys.stderr.write("mlx-test-trace: model load\n")
        sys.stderr.flush()
        return original(*args, **kwargs)

    owner._load = _load


def _count_decode_steps(generate, path):
    owner = generate.GenerationBatch
    original = owner.next
    steps = [0]

    def next(*args, **kwargs):
        steps[0] += 1
        with open(path + ".tmp", "w") as handle:
            handle.write(str(steps[0]))
        os.replace(path + ".tmp", path)
        return original(*args, **kwargs)

    owner.next = next


def _stamp_deaths(generate):
    """Bench-only: one stderr line when an exception first leaves a step.

    ``bench-death: <Type>: <message> t=<time.time()>``, then the exception goes
    on unchanged: the moment the generation thread starts to die, for the
    natural ``extend`` crash, where no injected fault announces it.
    """
    owner = generate.BatchGenerator
    original = owner.next
    stamped_once = [False]

    def next(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except BaseException as exc:
            if not stamped_once[0]:
                stamped_once[0] = True
                message = (str(exc).strip().splitlines() or ["(no message)"])[0][:200]
                sys.stderr.write("bench-death: %s: %s t=%.6f\n"
                                 % (exc.__class__.__name__, message, time.time()))
                sys.stderr.flush()
            raise

    owner.next = next


def _ignore_sigterm(trace):
    import signal

    def note(signum):
        with open(trace, "a") as handle:
            handle.write("%s pid=%d t=%.6f\n"
                         % (signal.Signals(signum).name, os.getpid(), time.time()))

    def on_sigterm(signum, _frame):
        note(signum)

    def on_sighup(signum, _frame):
        note(signum)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGHUP, on_sighup)


def _refuse_thread(name):
    import threading

    original = threading.Thread.start

    def start(self):
        if self.name == name:
            sys.stderr.write("mlx-test-fault: cannot start thread %s\n" % name)
            raise RuntimeError("can't start new thread")
        return original(self)

    threading.Thread.start = start


def _raise_in_plan(_server):
    from mlx_hotfix.patches import recover

    def plan(self, exc, during_startup):
        raise RuntimeError("injected: the recovery plan failed")

    recover.Recovery.plan = plan


def _raise_in_stop_once(server):
    import threading

    owner = server.GenerationContext
    original = owner.stop
    struck = []

    def stop(self):
        if not struck and threading.current_thread().name == "mlx-hotfix-disconnect":
            struck.append(True)
            raise RuntimeError("injected: ctx.stop failed")
        return original(self)

    owner.stop = stop


def _leak_per_request(server, size):
    owner = server.APIHandler
    original = owner.handle_completion
    held = []  # never freed: the leak

    def handle_completion(self, *args, **kwargs):
        if not self.headers.get("X-MLX-Watchdog-Probe"):
            held.append(b"\x01" * size)  # every page written: resident, not just reserved
        return original(self, *args, **kwargs)

    owner.handle_completion = handle_completion


_SHIM_FAULTS = {
    "reaper-start": None,  # installed at once: threads are not in a module we wait for
    "plan": _raise_in_plan,
    "stop-once": _raise_in_stop_once,
}


def _this_rank():
    wanted = os.environ.get("MLX_TEST_FAULT_RANK", "").strip()
    return not wanted or os.environ.get("MLX_RANK", "").strip() == wanted


def _install():
    wanted = []  # (module name, hook)
    if os.environ.get("MLX_TEST_TRACE_LOADS") == "1":
        wanted.append(("mlx_lm.server", _trace_loads))
    if os.environ.get("MLX_TEST_DECODE_COUNT_FILE"):
        path = os.environ["MLX_TEST_DECODE_COUNT_FILE"]
        wanted.append(("mlx_lm.generate", lambda m: _count_decode_steps(m, path)))
    if os.environ.get("MLX_TEST_DEATH_STAMP") == "1":
        wanted.append(("mlx_lm.generate", _stamp_deaths))
    if os.environ.get("MLX_TEST_LEAK_BYTES"):
        size = int(os.environ["MLX_TEST_LEAK_BYTES"])
        wanted.append(("mlx_lm.server", lambda m: _leak_per_request(m, size)))
    if _SPEC and _this_rank():
        action, kind, where, after = _parse(_SPEC)
        wanted.append((_TARGETS[where][0], lambda m: _inject(m, action, kind, where, after)))
    if os.environ.get("MLX_TEST_IGNORE_SIGTERM") and _this_rank():
        _ignore_sigterm(os.environ["MLX_TEST_IGNORE_SIGTERM"])
    shim_fault = os.environ.get("MLX_TEST_SHIM_FAULT", "")
    if shim_fault:
        if shim_fault not in _SHIM_FAULTS:
            raise ValueError("MLX_TEST_SHIM_FAULT: unknown fault %r" % shim_fault)
        if shim_fault == "reaper-start":
            _refuse_thread("mlx-hotfix-exit")
        else:
            wanted.append(("mlx_lm.server", _SHIM_FAULTS[shim_fault]))
    if wanted:
        when_imported = _shim_hooks()
        for name, hook in wanted:
            when_imported(name, hook)


_install()
