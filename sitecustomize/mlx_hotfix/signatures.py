"""Known ways mlx_lm.server dies, as data: one table of signatures.

Shared by the shim (the death line, the recover part's plan, reports) and the
watchdog (reports, status, restart causes, needs-attention), which loads this
file by path, as data (mlx_watchdog/signatures.py), the way it loads
pairings.py. Stdlib only, and imported only when a death is classified.

Each entry (``Signature``):
  cls            the class name, kebab-case (``metal-oom``)
  title          what happened, a few words
  patterns       regular expressions for the exact upstream texts; named groups
                 (rank, host, pid, errno, bytes, ...) become the match's detail
  exc_type       when set, a regular expression the exception's class name must
                 match in full; in stderr, the text must follow ``<Type>: ``
                 on its line (a traceback's last line)
  in_traceback   the patterns may also match the traceback, not only the message
  details        more patterns, searched once the class is known, for detail
                 only (the socket and errno of a ring failure, say)
  source         where the text comes from: upstream issue, PR or file:line
  restart_helps  a new process serves again (False: it fails the same way)
  gpu_fault      recovering in place cannot help, only a new process
                 (MLX_HOTFIX_RECOVER=thread exits 70 instead)
  config         the same failure after every restart: a configuration error
  group          a distributed group failure: restart the whole group
  remedy         one line for the operator, naming the flag or pin

The table is in priority order: the first entry with a matching pattern wins
(a crash report holds both the GPU timeout message and the generic Metal
abort frames; the timeout is the cause). Nothing matched is class
``unknown``; classify() and classify_text() never raise.

Tests: tests/test_signatures.py (each class on its real text, near misses,
recorded stderr, the table in docs/operator.md).
"""

import re

UNKNOWN = "unknown"


class Signature:
    __slots__ = ("cls", "title", "patterns", "exc_type", "in_traceback", "details", "source",
                 "restart_helps", "gpu_fault", "config", "group", "remedy",
                 "_patterns", "_exc_type", "_details")

    def __init__(self, cls, title, patterns, *, source, remedy, restart_helps=True,
                 gpu_fault=False, config=False, group=False, exc_type=None,
                 in_traceback=False, details=()):
        self.cls = cls
        self.title = title
        self.patterns = tuple(patterns)
        self.exc_type = exc_type
        self.in_traceback = in_traceback
        self.details = tuple(details)
        self.source = source
        self.restart_helps = restart_helps
        self.gpu_fault = gpu_fault
        self.config = config
        self.group = group
        self.remedy = remedy
        self._patterns = [re.compile(p) for p in self.patterns]
        self._exc_type = re.compile(exc_type) if exc_type else None
        self._details = [re.compile(p) for p in self.details]

    def __repr__(self):
        return "Signature(%r)" % self.cls

    # -- matching ---------------------------------------------------------------
    def type_matches(self, type_name):
        return self._exc_type is None or bool(self._exc_type.fullmatch(type_name or ""))

    def search(self, text):
        """The first pattern's match in text, or None."""
        for pattern in self._patterns:
            found = pattern.search(text)
            if found:
                return found
        return None

    def search_stderr(self, text):
        """Like search(), but a typed entry only where its text follows
        ``<Type>: `` on the same line, as a traceback's last line prints it."""
        if self._exc_type is None:
            return self.search(text)
        for pattern in self._patterns:
            for found in pattern.finditer(text):
                line_start = text.rfind("\n", 0, found.start()) + 1
                if _typed_prefix(self._exc_type, text[line_start:found.start()]):
                    return found
        return None

    def detail(self, found, text):
        """What the matched text says, then what the detail patterns find in text."""
        detail = _groups(found)
        for pattern in self._details:
            _merge(detail, pattern.search(text))
        return detail


_TYPE_NAME = re.compile(r"(?:^|[\s.\]])([A-Za-z_]\w*):\s")


def _typed_prefix(exc_type, prefix):
    # "ValueError: " or "huggingface_hub.errors.HFValidationError: ", after
    # anything (a log prefix, "generation thread died: ") and before the text.
    return any(exc_type.fullmatch(found.group(1)) for found in _TYPE_NAME.finditer(prefix))


def _merge(detail, found):
    """Add what found (a match, or None) says to detail; what is there stays."""
    if found is not None:
        for key, value in _groups(found).items():
            detail.setdefault(key, value)


def _groups(found):
    detail = {}
    for key, value in found.groupdict().items():
        if value is None:
            continue
        value = value.strip()
        if re.fullmatch(r"\d[\d,]*", value):
            value = int(value.replace(",", ""))
        detail[key] = value
    return detail


class Match:
    """What a death was: its class, the table entry, and what the text said."""

    __slots__ = ("cls", "entry", "detail")

    def __init__(self, entry, detail=None):
        self.cls = entry.cls
        self.entry = entry
        self.detail = dict(detail or {})

    def __repr__(self):
        return "Match(%r, %r)" % (self.cls, self.detail)

    def __eq__(self, other):
        return isinstance(other, Match) and (self.cls, self.detail) == (other.cls, other.detail)

    @property
    def known(self):
        return self.cls != UNKNOWN

    def as_dict(self):
        """For reports and JSON: the class, its remedy and what is known."""
        entry = self.entry
        return {"cause": self.cls, "title": entry.title, "remedy": entry.remedy,
                "restart_helps": entry.restart_helps, "gpu_fault": entry.gpu_fault,
                "config": entry.config, "source": entry.source, "detail": dict(self.detail)}


# -- texts shared by several entries --------------------------------------------

# mlx.launch, when a rank ends (mlx/_distributed_utils/launch.py, "Node with
# rank N was killed" / "... exited with code C"): the rank that failed first.
_LAUNCHER_RANK = (r"Node with rank (?P<failed_rank>\d+) "
                  r"(?:was killed|exited with code (?P<failed_exit_code>-?\d+))")
# The shim's own prefix in a group (mlx_hotfix/log.py): who reported it.
REPORTER = re.compile(r"mlx-hotfix: \[rank (?P<rank>\d+) on (?P<host>[^\]\s]+)\]")

_GROUP = "restart the whole group (every rank)"

TABLE = (
    # -- configuration: the same failure after every restart ---------------------
    Signature(
        "config-model-path", "--model names nothing that can be loaded",
        (r"Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
         r"'(?P<model>[^']*)'",
         r"Repository Not Found for url: (?P<url>\S+?)\.?(?=\s|$)",
         r"Cannot find an appropriate cached snapshot folder for the specified revision on "
         r"the local disk and outgoing traffic has been disabled",
         r"No safetensors found in (?P<model>[^\n]+)",
         r"No such file or directory: '(?P<model>[^'\n]*)/config\.json'"),
        source="huggingface_hub validate_repo_id / snapshot_download; mlx_lm/utils.py "
               "load_model ('No safetensors found in'), load_config (config.json); "
               "recorded on stock 0.31.3 and 0.32.2",
        restart_helps=False, config=True,
        remedy="fix --model: a local folder with config.json and *.safetensors, or a "
               "Hugging Face repo id already in the cache when HF_HUB_OFFLINE=1"),
    Signature(
        "config-model-type", "this mlx-lm does not know the model's architecture",
        (r"Model type (?P<model_type>\S+) not supported\.",),
        exc_type=r"ValueError",
        source="mlx_lm/utils.py _get_classes",
        restart_helps=False, config=True,
        remedy="upgrade mlx-lm (pip install -U mlx-lm) or choose another --model"),
    Signature(
        "config-missing-parameters", "the weights do not match this mlx-lm's model",
        (r"Missing (?P<missing>\d+) parameters",
         r"Received (?P<extra>\d+) parameters not in model"),
        exc_type=r"ValueError",
        source="mlx/nn/layers/base.py load_weights; 'Missing 627 parameters "
               "(self_attn.indexer.*)' in mlx-lm #1493; recorded on stock 0.31.3 and 0.32.2",
        restart_helps=False, config=True,
        remedy="run the mlx-lm release the model was converted for (pin it in the "
               "server's venv), or re-download or re-convert --model"),
    Signature(
        "config-bad-pair", "mlx-lm and mlx do not go together",
        (r"There is no Stream\((?P<device>cpu|gpu), \d+\) in current thread",),
        source="mlx backend/{cpu/encoder,metal/device}.cpp (mlx 0.32: a stream per "
               "thread); mlx-lm #1179; ARCHITECTURE.md 'Patches by release'",
        restart_helps=False, config=True,
        remedy="pip install 'mlx<0.32' (tested: mlx==0.31.2) or upgrade mlx-lm to 0.31.3 "
               "or later; mlx-watchdog doctor names the pair"),
    # -- the GPU: only a new process recovers ------------------------------------
    Signature(
        "gpu-timeout", "a GPU command buffer ran past the macOS GPU watchdog",
        (r"kIOGPUCommandBufferCallbackErrorTimeout\b",
         r"kIOGPUCommandBufferCallbackErrorImpactingInteractivity\b"),
        source="'[METAL] Command buffer execution failed: Caused GPU Timeout Error "
               "(00000002:kIOGPUCommandBufferCallbackErrorTimeout).' mlx "
               "backend/metal/device.cpp; omlx #2029; ollama #17902; exo PR #1620; "
               "Impacting Interactivity: Acelogic/LTX-2-MLX #5",
        gpu_fault=True,
        remedy="only a new process recovers (this one is in the GPU penalty box); lower "
               "--prefill-step-size so each GPU command is shorter"),
    Signature(
        "gpu-penalty-box", "macOS ignores this process's GPU work after earlier errors",
        (r"Ignored \(for causing prior/excessive GPU errors\)",
         r"kIOGPUCommandBufferCallbackErrorSubmissionsIgnored\b"),
        source="'Ignored (for causing prior/excessive GPU errors) "
               "(00000004:kIOGPUCommandBufferCallbackErrorSubmissionsIgnored)' omlx #3706",
        gpu_fault=True,
        remedy="only a new process clears it; the first GPU error before it (usually a "
               "timeout) is the cause"),
    Signature(
        "gpu-invalid-resource", "a Metal buffer was used after it was freed",
        (r"kIOGPUCommandBufferCallbackErrorInvalidResource\b",
         r"Invalid Resource \(IOAF code 9\)"),
        source="'[METAL] Command buffer execution failed: Invalid Resource "
               "(00000009:kIOGPUCommandBufferCallbackErrorInvalidResource)' mlx #3689 (fix "
               "PR #3688); Blaizzy/mlx-vlm #270",
        gpu_fault=True,
        remedy="only a new process recovers; upgrade mlx to a release with mlx PR #3688"),
    Signature(
        "metal-oom", "the GPU ran out of memory",
        (r"kIOGPUCommandBufferCallbackErrorOutOfMemory\b",
         r"\[METAL\] Command buffer execution failed: Insufficient Memory"),
        source="'[METAL] Command buffer execution failed: Insufficient Memory "
               "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)' mlx PR #479; mlx-lm "
               "#1390; a RuntimeError from mlx 0.32.0 (mlx PR #3523), an abort before",
        gpu_fault=True,
        remedy="only a new process recovers; use less memory: --decode-concurrency, "
               "--prompt-cache-bytes, --prefill-step-size, or a smaller quantization"),
    # -- the allocator -------------------------------------------------------------
    Signature(
        "metal-buffer-count", "Metal's live-buffer count ran out",
        (r"\[metal::malloc\] Resource limit \((?P<limit>\d+)\) exceeded",),
        source="mlx backend/metal/allocator.cpp:143; mlx-lm #1505, #1672 (from "
               "ArraysCache.advance, mlx-lm #1845)",
        remedy="a restart clears the count; keep the shim's advance part on (mlx-lm "
               "#1845) and lower --decode-concurrency"),
    Signature(
        "metal-too-big", "one buffer larger than Metal allows",
        (r"\[metal::malloc\] Attempting to allocate (?P<bytes>\d+) bytes which is greater "
         r"than the maximum allowed buffer size of (?P<max_bytes>\d+) bytes",),
        source="mlx backend/metal/allocator.cpp:116",
        remedy="a single request needs too large a buffer: lower --max-tokens or "
               "--prefill-step-size, or cap prompt length at the proxy"),
    Signature(
        "alloc-fail", "the system could not give Metal the memory",
        (r"\[malloc\] Unable to allocate (?P<bytes>\d+) bytes",),
        source="mlx backend/metal/allocator.cpp:156",
        remedy="memory is short: a restart frees it; lower --decode-concurrency or "
               "--prompt-cache-bytes, or free memory on the Mac"),
    # -- mlx-lm bugs that kill the generation thread ------------------------------
    Signature(
        "extend", "mlx-lm 0.31.x extend: a batch mixing penalties",
        (r"'NoneType' object is not iterable",),
        exc_type=r"TypeError",
        source="'TypeError: 'NoneType' object is not iterable' at 'for processor in "
               "self.logits_processors[e]' (generate.py GenerationBatch._step), mlx-lm "
               "#1472, #1505, fixed in 0.32.0",
        remedy="keep the shim's extend part on, or upgrade mlx-lm to 0.32.0 or later"),
    Signature(
        "slice", "a batch index beyond 32 bits",
        (r"Slice indices must be 32-bit integers",),
        source="mlx python/src/indexing.cpp ('Slice indices must be 32-bit integers.'); "
               "mlx-lm #1505",
        remedy="a restart helps; add the crash report to mlx-lm #1505"),
    Signature(
        "broadcast", "a mask that does not fit an empty KV cache",
        (r"\[broadcast_shapes\] Shapes (?P<shapes>.+?) cannot be broadcast",),
        source="mlx mlx/utils.cpp broadcast_shapes; the mask-vs-empty-KV error of mlx-lm "
               "#1505",
        remedy="a restart helps; add the crash report to mlx-lm #1505"),
    Signature(
        "extract", "BatchGenerator.extract_cache failed",
        (r"extract_cache\b",),
        in_traceback=True,
        source="an exception out of batch_generator.extract_cache (any message), mlx-lm "
               "#1505, #1909",
        remedy="a restart helps; add the crash report to mlx-lm #1909"),
    # -- distributed groups -------------------------------------------------------
    Signature(
        "jaccl-no-gid", "the Thunderbolt RDMA port has no usable (IPv4) GID",
        (r"\[jaccl\] Changing queue pair to RTR failed with errno (?P<errno>22)\b",
         r"\[jaccl\] No IPv4-mapped GID for this device"),
        source="mlx distributed/jaccl/lib/jaccl/rdma.cpp; mlx #3467 (errno 22 from mlx "
               "0.31.2), reported as 'No IPv4-mapped GID' from 0.32.1 (mlx PR #4191); "
               "'Thunderbolt Bridge active' in mlx #3207",
        restart_helps=False, config=True, group=True, details=(_LAUNCHER_RANK,),
        remedy="take the Thunderbolt ports out of the Thunderbolt Bridge and give each an "
               "IPv4 address (ifconfig <interface> inet 169.254.0.1 netmask 255.255.0.0 "
               "alias) on every host"),
    Signature(
        "jaccl-stale-rdma", "stale RDMA resources on a host",
        (r"\[jaccl\] Changing queue pair to RTR failed with errno (?P<errno>16)\b",
         r"\[jaccl\] Couldn't allocate protection domain"),
        source="mlx #3207: 'RTR errno 16 (EBUSY)', stale RDMA resources from a crash; "
               "'Couldn't allocate protection domain' after many init/teardown cycles",
        restart_helps=False, config=True, group=True, details=(_LAUNCHER_RANK,),
        remedy="reboot the Mac that failed (stale RDMA resources); restarting the group "
               "alone fails the same way"),
    Signature(
        "jaccl-rdma-missing", "no RDMA device on a host",
        (r"ibv_reg_mr(?:_iova2)?\b",
         r"\[jaccl\] Could not (?:find|open) device (?P<device>\S+)"),
        source="SIGSEGV in ibv_reg_mr / ibv_reg_mr_iova2 with a null protection domain, "
               "mlx #3777; 'Could not find device' mlx distributed/jaccl/lib/jaccl/rdma.cpp",
        restart_helps=False, config=True, group=True, details=(_LAUNCHER_RANK,),
        remedy="enable RDMA from Recovery OS (rdma_ctl enable) and reboot; ibv_devices "
               "must list an rdma_* device"),
    Signature(
        "jaccl-link-lost", "a Thunderbolt RDMA link went away mid-collective",
        (r"tbt_post_(?:recv|send)\b",),
        source="SIGSEGV in libthunderboltrdma tbt_post_recv, mlx #4192, #4485, #4319",
        group=True, details=(_LAUNCHER_RANK,),
        remedy="check the Thunderbolt cable between the hosts, then " + _GROUP),
    Signature(
        "jaccl-peer-lost", "a peer died while the group was starting",
        (r"\[jaccl\] (?:Recv|Send) failed with errno=(?P<errno>\d+)",),
        source="mlx distributed/jaccl/lib/jaccl/tcp.cpp; 'Recv failed with errno=2', mlx "
               "PR #4530",
        group=True, details=(_LAUNCHER_RANK,),
        remedy=_GROUP + "; the failed rank's own log says why it died"),
    Signature(
        "ring-peer-lost", "a ring peer went away (mlx 0.32.1 and later)",
        (r"\[ring\] connection to a peer was lost",
         r"\[ring\] Too many send/recv errors\. Failing pending tasks"),
        source="mlx distributed/ring/ring.cpp (mlx commit 8c28c385f, PR #4060, in 0.32.1): "
               "'Socket N was closed by the peer', 'Too many send/recv errors. Failing "
               "pending tasks...', RuntimeError on the survivors",
        group=True,
        details=(_LAUNCHER_RANK,
                 r"(?:Receiving from|Sending to) socket (?P<fd>\d+) failed with errno "
                 r"(?P<errno>\d+)",
                 r"Socket (?P<fd>\d+) was closed by the peer"),
        remedy="check the host of the rank that failed (named here), then " + _GROUP),
    Signature(
        "ring-abort", "a ring peer failed and every rank wedged (mlx 0.32.0 and earlier)",
        (r"\[ring\] Too many send/recv errors\. Aborting",),
        source="mlx distributed/ring/ring.cpp in 0.32.0: '[ring] Receiving from socket 51 "
               "failed with errno 54' x10, then 'Too many send/recv errors. Aborting...', "
               "then a silent wedge, mlx #3862",
        group=True,
        details=(_LAUNCHER_RANK,
                 r"(?:Receiving from|Sending to) socket (?P<fd>\d+) failed with errno "
                 r"(?P<errno>\d+)"),
        remedy=_GROUP + "; upgrade mlx to 0.32.1 or later, where a lost peer raises "
               "instead of wedging"),
    Signature(
        "group-connect", "a rank could not reach its peer at start",
        (r"\[(?P<backend>ring|jaccl)\] Couldn't connect \(error: (?P<errno>\d+)\)",),
        source="mlx distributed/utils.cpp TCPSocket::connect; mlx #3755",
        group=True, details=(_LAUNCHER_RANK,),
        remedy="check that every host in the hostfile is up and reachable at its IPs "
               "(mlx-watchdog doctor --hostfile)"),
    # -- the machine ----------------------------------------------------------------
    Signature(
        "kernel-panic", "macOS panicked in the GPU driver (the Mac rebooted)",
        (r"completeMemory\(\) prepare count underflow",
         r"IOGPUGroupMemory::remove_memory_object\(\) memory object not found",
         r"watchdog timeout: no checkins from watchdogd"),
        source="panic reports: '\"completeMemory() prepare count underflow\" "
               "@IOGPUMemory.cpp:550' mlx #3186, #3346; remove_memory_object mlx #3346; "
               "watchdogd mlx #3267",
        remedy="update macOS and lower GPU memory use; add the panic report to mlx #3346"),
    Signature(
        "jetsam", "macOS killed the process for memory (jetsam)",
        (r"\"largestProcess\"\s*:\s*\"(?P<largest_process>[^\"]*)\"",),
        source="JetsamEvent-<date>.ips ('\"largestProcess\" : \"Python\"', reason "
               "vm-compressor-space-shortage, exit -9), omlx #702; Apple 'Identifying "
               "high-memory use with jetsam event reports'",
        details=(r"\"reason\"\s*:\s*\"(?P<reason>[^\"]*)\"",),
        remedy="use less memory (a smaller model or quantization, --prompt-cache-bytes, "
               "--decode-concurrency) or leave more free on the Mac"),
    # -- the handler ------------------------------------------------------------------
    Signature(
        "broken-pipe", "a streaming client hung up and the error took the process down",
        (r"\[Errno 32\] Broken pipe",),
        exc_type=r"BrokenPipeError",
        source="'BrokenPipeError: [Errno 32] Broken pipe' at self.wfile.write(...) on "
               "0.31.3, mlx-lm PR #677 comment",
        remedy="keep the shim's exit and disconnect parts on, or upgrade mlx-lm"),
    # -- generic aborts, after every specific message -------------------------------
    Signature(
        "metal-abort", "a Metal error aborted the process (mlx 0.31 and earlier)",
        (r"mlx::core::gpu::check_error\(MTL::CommandBuffer\*\)",
         r"Crashed::?\s+Dispatch queue: com\.Metal\.CompletionQueueDispatch",
         r"terminating due to uncaught exception of type std::runtime_error: \[METAL\] "
         r"Command buffer execution failed"),
        source="check_error on com.Metal.CompletionQueueDispatch in the .ips crash report, "
               "omlx #354, #1548; mlx #3317, #3390",
        gpu_fault=True,
        remedy="upgrade mlx to 0.32.0 or later, where a Metal error is a Python exception "
               "(mlx PR #3523)"),
    Signature(
        "metal-error", "a Metal command buffer failed",
        (r"\[METAL\] Command buffer execution failed: (?P<error>[^\n]*)",),
        source="mlx backend/metal/device.cpp CommandEncoder::commit (a RuntimeError from "
               "0.32.0, mlx PR #3523)",
        gpu_fault=True,
        remedy="only a new process recovers; add the message to an mlx issue"),
    Signature(
        "native-abort", "a C++ exception aborted the process",
        (r"libc\+\+abi: terminating due to uncaught exception of type (?P<error>[^\n]*)",),
        source="libc++abi's terminate handler (SIGABRT, exit code 6 / -6)",
        remedy="the fatal-stacks report shows where; add it to an mlx issue"),
    # -- killed with no word ------------------------------------------------------------
    Signature(
        "killed", "killed (SIGKILL) without a word",
        (r"Killed process (?P<pid>\d+) \((?P<process>[^)]*)\)"
         r"(?: total-vm:(?P<total_vm_kb>[\d,]+)kB, anon-rss:(?P<anon_rss_kb>[\d,]+)kB)?",
         r"oom-kill:constraint=(?P<constraint>[^,\s]+),[^\n]*?task=(?P<process>[^,\n]*),"
         r"pid=(?P<pid>\d+)",
         r"Node with rank (?P<failed_rank>\d+) was killed"),
        source="Linux mm/oom_kill.c ('Out of memory: Killed process N (python) total-vm:...'"
               ", 'oom-kill:...,task=python,pid=N'); mlx.launch 'Node with rank N was killed'",
        remedy="the kernel's OOM killer, jetsam or a person: if memory, use less of it "
               "(--decode-concurrency, --prompt-cache-bytes, a smaller model)"),
)

UNKNOWN_ENTRY = Signature(
    UNKNOWN, "not a known signature", (),
    source="-",
    remedy="read the crash report (mlx-watchdog reports show 1 --markdown) and add it to "
           "mlx-lm #1505 or a new issue")

BY_CLASS = {entry.cls: entry for entry in TABLE + (UNKNOWN_ENTRY,)}


def entry(cls):
    """The table entry for a class name; the ``unknown`` entry for any other."""
    return BY_CLASS.get(cls, UNKNOWN_ENTRY)


def classify(exc_type_name, message, traceback=None):
    """The class of an exception, from its class name and message (and, for
    entries that look there, its formatted traceback). Never raises."""
    try:
        type_name = str(exc_type_name or "")
        message = str(message or "")
        for sig in TABLE:
            if not sig.type_matches(type_name):
                continue
            found = sig.search(message)
            where = message
            if found is None and sig.in_traceback and traceback:
                where = str(traceback)
                found = sig.search(where)
            if found is not None:
                return Match(sig, sig.detail(found, where))
    except Exception:  # noqa: BLE001 - classifying must never make a death worse
        pass
    return Match(UNKNOWN_ENTRY)


def classify_text(text):
    """The class of a death from text it left: stderr, a fatal-stacks file, a
    crash or panic report, a group's combined output. Never raises. Give it
    the tail that matters (tens of kB): it reads about 5 MB a second."""
    try:
        text = str(text or "")
        for sig in TABLE:
            found = sig.search_stderr(text)
            if found is None:
                continue
            detail = sig.detail(found, text)
            line_start = text.rfind("\n", 0, found.start()) + 1
            line_end = text.find("\n", found.end())
            # In a group, the shim's own line names the rank and host that saw it.
            _merge(detail, REPORTER.search(text[line_start:None if line_end < 0 else line_end]))
            return Match(sig, detail)
    except Exception:  # noqa: BLE001
        pass
    return Match(UNKNOWN_ENTRY)


def reporters(text, sig):
    """{rank: host} of each rank whose own (mlx-hotfix) line in text shows sig:
    in a group's output, the survivors that saw a peer go."""
    found = {}
    try:
        for line in str(text or "").splitlines():
            who = REPORTER.search(line)
            if who and sig.search_stderr(line):
                found[int(who.group("rank"))] = who.group("host")
    except Exception:  # noqa: BLE001
        pass
    return found
