"""Memory in the heartbeat, and trimming on the watchdog's request.

The ``memory`` object of the heartbeat record and of /health (heartbeat.py)::

    {"rss": 9876543210, "phys_footprint": 51234567890,
     "mlx_active": 48123456789, "mlx_cache": 1234567, "mlx_peak": 49000000000,
     "prompt_cache_bytes": 2147483648, "prompt_cache_entries": 7,
     "trimmed": {"request": 3, "time": 1764525600.4, "prompt_cache_bytes": 1073741824,
                 "prompt_cache_entries": 4, "mlx_cache_bytes": 1234567}}

- ``rss``: resident set size (Linux: /proc/self/statm; macOS: the rusage's
  ``ri_resident_size``). ``phys_footprint`` (macOS only, footprint.py): what
  jetsam and Activity Monitor count, GPU memory included.
- ``mlx_active``, ``mlx_cache``, ``mlx_peak``: ``mx.get_active_memory()``,
  ``get_cache_memory()``, ``get_peak_memory()`` (top level since mlx 0.24,
  ml-explore/mlx#1982; before that only ``mx.metal.*``, read only when Metal
  is there).
- ``prompt_cache_bytes``, ``prompt_cache_entries``: the server's
  ``LRUPromptCache`` (its ``nbytes`` and ``len``).
- ``trimmed``: what the last trim freed (below); kept until the next one.
A value that cannot be had is left out, never written as 0. Sampled at most
once per MLX_HOTFIX_HEARTBEAT_INTERVAL, whoever asks (the loop's beat, the
keeper, /health), never on the per-token path.

**The request file** ``<MLX_HOTFIX_HEARTBEAT_FILE>.memory`` (next to the
heartbeat this process writes; the watchdog writes it atomically)::

    {"pid": 4242, "trim": 3, "soft_until": 1764525660.0}

- ``pid``: the server process the request is for; any other pid (a file
  left from an earlier process) is ignored.
- ``trim``: a request number. When it differs from the last one served, the
  generation thread, at its next heartbeat write (between two steps, where
  nothing uses the prompt cache), trims the prompt cache to half its bytes
  (``LRUPromptCache.trim_to``, least recently used first), calls
  ``mx.clear_cache()``, logs one line, and reports ``memory.trimmed`` with
  that number. At most one trim per MIN_TRIM_INTERVAL_S; a request that
  comes sooner waits. In an ``mx.distributed`` group only the MLX buffer
  cache is freed: ranks must keep identical prompt caches, or the next
  cache hit would differ between them and the group would hang.
- ``soft_until``: unix time until which /health answers 503
  ``{"status": "memory"}`` (the watchdog's soft line: new work goes
  elsewhere), held at most MAX_SOFT_HOLD_S past the moment the file was
  read, so a file whose writer is gone lets go on its own.

A hostile writer of that folder (it should be writable by the server's and
the watchdog's users only, like the heartbeat's) gets no more than that:
the file is opened without following a link and without blocking on a FIFO,
must be a regular file of at most MAX_REQUEST_BYTES, and anything else is
no request. The file is re-read only when its stat signature changes.
"""

import os
import sys
import threading
import time

from . import config

REQUEST_SUFFIX = ".memory"
MAX_REQUEST_BYTES = 4096
MAX_SOFT_HOLD_S = 600.0
MIN_TRIM_INTERVAL_S = 10.0
_MLX_FIELDS = (("mlx_active", "get_active_memory"), ("mlx_cache", "get_cache_memory"),
               ("mlx_peak", "get_peak_memory"))

_lock = threading.Lock()  # the sample and the parsed request, shared by threads
_generator = None  # a weak reference to the ResponseGenerator (attach)
_sample = None
_sampled_at = None  # monotonic time of _sample
_request_signature = None
_request = {}
_request_checked_at = None  # monotonic; the generation thread's last look
_served_trim = None  # the last request number served
_last_trim_at = None  # monotonic
_trimmed = None  # what the last trim freed


def attach(generator):
    """The server's ResponseGenerator (its prompt cache is measured and trimmed)."""
    global _generator, _sample
    import weakref

    try:
        _generator = weakref.ref(generator)
    except TypeError:
        _generator = lambda: generator  # noqa: E731 - an object without weakref support
    with _lock:
        _sample = None  # measure the new generator's cache at the next ask


def fields(trim_point=False):
    """The memory object (see the module doc). With trim_point (the generation
    thread, between steps) a pending trim request is served first."""
    global _sample, _sampled_at
    now = time.monotonic()
    if trim_point:
        _serve_trim(now)
    with _lock:
        if _sample is None or now - _sampled_at >= config.current().heartbeat_interval:
            _sample = _measure()
            _sampled_at = now
        sample = dict(_sample)
    if _trimmed is not None:
        sample["trimmed"] = dict(_trimmed)
    return sample


def soft():
    """Whether the watchdog's request says /health must answer 503 "memory"."""
    with _lock:
        until = _poll().get("soft_until")
    return until is not None and time.time() < until


# -- measuring -------------------------------------------------------------------


def _measure():
    data = {}
    usage = _footprint()
    if usage is not None:
        data["rss"] = usage["resident_size"]
        data["phys_footprint"] = usage["phys_footprint"]
    else:
        rss = _proc_rss()
        if rss is not None:
            data["rss"] = rss
    core = sys.modules.get("mlx.core")
    for key, name in _MLX_FIELDS:
        value = _mlx_call(core, name)
        if isinstance(value, int):
            data[key] = value
    cache = _prompt_cache()
    if cache is not None:
        nbytes = getattr(cache, "nbytes", None)
        if isinstance(nbytes, int):
            data["prompt_cache_bytes"] = nbytes
        try:
            data["prompt_cache_entries"] = len(cache)
        except Exception:  # noqa: BLE001 - a cache of another shape: leave it out
            pass
    return data


def _footprint():
    if sys.platform != "darwin":
        return None
    try:
        from . import footprint

        return footprint.read(os.getpid())
    except Exception:  # noqa: BLE001 - a missing value, never a failed beat
        return None


def _proc_rss():
    try:
        with open("/proc/self/statm", "rb") as handle:
            pages = int(handle.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def mlx_function(core, name):
    """mx.<name>, else mx.metal.<name> where Metal is there (mlx before 0.24)."""
    if core is None:
        return None
    function = getattr(core, name, None)
    if function is None:
        metal = getattr(core, "metal", None)
        try:
            if metal is not None and metal.is_available():
                function = getattr(metal, name, None)
        except Exception:  # noqa: BLE001
            function = None
    return function


def _mlx_call(core, name):
    function = mlx_function(core, name)
    if function is None:
        return None
    try:
        return function()
    except Exception:  # noqa: BLE001
        return None


def _prompt_cache():
    generator = _generator() if _generator is not None else None
    return getattr(generator, "prompt_cache", None)  # gone once the loop has ended


# -- the watchdog's request --------------------------------------------------------


def request_path():
    beat = config.current().heartbeat_file
    return beat + REQUEST_SUFFIX if beat else None


def read_request(path, pid, now):
    """{"trim": int or None, "soft_until": float or None} from the request
    file at path, if it is a request for process pid; else None. Never raises."""
    import json
    import stat

    flags = os.O_RDONLY
    for name in ("O_NOFOLLOW", "O_NONBLOCK", "O_CLOEXEC"):
        flags |= getattr(os, name, 0)
    try:
        descriptor = os.open(path, flags)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return None
        raw = os.read(descriptor, MAX_REQUEST_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(descriptor)
    if len(raw) > MAX_REQUEST_BYTES:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    if not isinstance(data, dict) or not _is_int(data.get("pid")) or data["pid"] != pid:
        return None
    trim = data.get("trim")
    until = data.get("soft_until")
    if not (isinstance(until, (int, float)) and not isinstance(until, bool)
            and until == until and abs(until) != float("inf")):
        until = None
    return {
        "trim": trim if _is_int(trim) and trim >= 0 else None,
        "soft_until": None if until is None else min(float(until), now + MAX_SOFT_HOLD_S),
    }


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _poll():
    """The current request (held under _lock): the file is re-read only when
    its stat signature changes, so a poll costs one lstat."""
    global _request_signature, _request
    path = request_path()
    if path is None:
        return {}
    try:
        info = os.lstat(path)
    except OSError:
        _request_signature, _request = None, {}
        return _request
    signature = (info.st_ino, info.st_dev, info.st_size, info.st_mtime_ns, info.st_mode)
    if signature != _request_signature:
        _request_signature = signature
        _request = read_request(path, os.getpid(), time.time()) or {}
    return _request


def _serve_trim(now):
    global _request_checked_at, _served_trim, _last_trim_at, _trimmed, _sample
    if (_request_checked_at is not None
            and now - _request_checked_at < config.current().heartbeat_interval):
        return
    _request_checked_at = now
    with _lock:
        wanted = _poll().get("trim")
    if wanted is None or wanted == _served_trim:
        return
    if _last_trim_at is not None and now - _last_trim_at < MIN_TRIM_INTERVAL_S:
        return  # served at a later beat
    _served_trim, _last_trim_at = wanted, now
    try:
        _trimmed = trim(wanted)
    except Exception as exc:  # noqa: BLE001 - a failed trim must not cost the loop
        from . import log

        log.say("memory: trim request %d failed (%s: %s)" % (wanted, exc.__class__.__name__, exc))
    with _lock:
        _sample = None  # the next record shows memory after the trim


def trim(request):
    """Halve the prompt cache and free MLX's buffer cache; returns what was freed.

    Call it on the generation thread only: it evicts prompt-cache entries."""
    generator = _generator() if _generator is not None else None
    cache = getattr(generator, "prompt_cache", None)
    core = sys.modules.get("mlx.core")
    result = {"request": request, "time": time.time()}
    notes = []
    if cache is not None and callable(getattr(cache, "trim_to", None)):
        if getattr(generator, "_is_distributed", False):
            notes.append("prompt cache kept (an mx.distributed group keeps one cache per rank, "
                         "identical on every rank)")
        else:
            bytes_before, entries_before = cache.nbytes, len(cache)
            cache.trim_to(n_bytes=bytes_before // 2)
            result["prompt_cache_bytes"] = bytes_before - cache.nbytes
            result["prompt_cache_entries"] = entries_before - len(cache)
            notes.append("prompt cache %d -> %d bytes (%d of %d entries dropped)" % (
                bytes_before, cache.nbytes, result["prompt_cache_entries"], entries_before))
    clear = mlx_function(core, "clear_cache")
    if clear is not None:
        cached = _mlx_call(core, "get_cache_memory")
        clear()
        after = _mlx_call(core, "get_cache_memory")
        if isinstance(cached, int) and isinstance(after, int):
            result["mlx_cache_bytes"] = cached - after
            notes.append("MLX buffer cache %d bytes freed" % (cached - after))
    from . import log

    log.say("memory: trimmed on request %d: %s" % (request, "; ".join(notes) or "nothing to trim"))
    return result
