"""The table of death signatures (sitecustomize/mlx_hotfix/signatures.py), as
the watchdog loads it: each class on its real text, a near miss for each, the
order of the table, stderr recorded from real runs, and the table in docs/operator.md.

Texts are quoted from the upstream sources the table cites; the files in
tests/data/signatures/ were recorded on this machine (stock servers 0.31.3 and
0.32.2 with a bad --model; a real mlx 0.32.4 ring group losing a rank; a real
OOM kill in a memory cgroup on Linux 6.18).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from harness.server import SHIM_DIR
from mlx_watchdog import signatures

DATA = Path(__file__).parent / "data" / "signatures"
OPERATOR_GUIDE = Path(__file__).parent.parent / "docs" / "operator.md"
T = signatures.table()

# (class, exception type, message): what the generation thread raises.
EXCEPTIONS = [
    ("config-model-path", "HFValidationError",
     "Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
     "'/Users/me/models/qwen'. Use `repo_type` argument if needed."),
    ("config-model-path", "LocalEntryNotFoundError",
     "Cannot find an appropriate cached snapshot folder for the specified revision on the "
     "local disk and outgoing traffic has been disabled. To enable repo look-ups and "
     "downloads online, set 'HF_HUB_OFFLINE=0' as environment variable."),
    ("config-model-path", "RepositoryNotFoundError",
     "404 Client Error.\n\nRepository Not Found for url: "
     "https://huggingface.co/api/models/mlx-community/NoSuch-4bit/revision/main.\n"
     "Please make sure you specified the correct `repo_id` and `repo_type`."),
    ("config-model-path", "FileNotFoundError", "No safetensors found in /Users/me/models/qwen"),
    ("config-model-path", "FileNotFoundError",
     "[Errno 2] No such file or directory: '/Users/me/models/qwen/config.json'"),
    ("config-model-type", "ValueError", "Model type qwen9_moe not supported."),
    ("config-missing-parameters", "ValueError",
     "Missing 627 parameters: \nmodel.layers.0.self_attn.indexer.k_norm.bias,\n"
     "model.layers.0.self_attn.indexer.k_norm.weight."),
    ("config-missing-parameters", "ValueError",
     "Received 2 parameters not in model: \nlm_head.biases,\nlm_head.scales."),
    ("config-bad-pair", "RuntimeError", "There is no Stream(cpu, 0) in current thread."),
    ("config-bad-pair", "RuntimeError", "There is no Stream(gpu, 0) in current thread."),
    ("gpu-timeout", "RuntimeError",
     "[METAL] Command buffer execution failed: Caused GPU Timeout Error "
     "(00000002:kIOGPUCommandBufferCallbackErrorTimeout)."),
    ("gpu-timeout", "RuntimeError",
     "[METAL] Command buffer execution failed: Impacting Interactivity "
     "(0000000e:kIOGPUCommandBufferCallbackErrorImpactingInteractivity)"),
    ("gpu-penalty-box", "RuntimeError",
     "[METAL] Command buffer execution failed: Ignored (for causing prior/excessive GPU "
     "errors) (00000004:kIOGPUCommandBufferCallbackErrorSubmissionsIgnored)."),
    ("gpu-invalid-resource", "RuntimeError",
     "[METAL] Command buffer execution failed: Invalid Resource "
     "(00000009:kIOGPUCommandBufferCallbackErrorInvalidResource)."),
    ("metal-oom", "RuntimeError",
     "[METAL] Command buffer execution failed: Insufficient Memory "
     "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)."),
    ("metal-oom", "RuntimeError", "[METAL] Command buffer execution failed: Insufficient Memory"),
    ("metal-buffer-count", "RuntimeError", "[metal::malloc] Resource limit (499000) exceeded."),
    ("metal-too-big", "RuntimeError",
     "[metal::malloc] Attempting to allocate 34359738368 bytes which is greater than the "
     "maximum allowed buffer size of 22906503168 bytes."),
    ("alloc-fail", "RuntimeError", "[malloc] Unable to allocate 8589934592 bytes."),
    ("extend", "TypeError", "'NoneType' object is not iterable"),
    ("slice", "ValueError", "Slice indices must be 32-bit integers."),
    ("broadcast", "ValueError",
     "[broadcast_shapes] Shapes (1,8,1,16) and (1,8,1,0) cannot be broadcast."),
    ("extract", "IndexError", "list index out of range (in extract_cache)"),
    ("jaccl-no-gid", "RuntimeError", "[jaccl] Changing queue pair to RTR failed with errno 22"),
    ("jaccl-no-gid", "RuntimeError",
     "[jaccl] No IPv4-mapped GID for this device. Thunderbolt RDMA ports only publish one "
     "once the interface has an IPv4 address; assign a link-local address to it, for "
     "example: ifconfig <interface> inet 169.254.0.1 netmask 255.255.0.0 alias"),
    ("jaccl-stale-rdma", "RuntimeError", "[jaccl] Changing queue pair to RTR failed with errno 16"),
    ("jaccl-stale-rdma", "RuntimeError", "[jaccl] Couldn't allocate protection domain"),
    ("jaccl-rdma-missing", "RuntimeError", "[jaccl] Could not find device rdma_en5 (0 devices)"),
    ("jaccl-peer-lost", "RuntimeError", "[jaccl] Recv failed with errno=2"),
    ("ring-peer-lost", "RuntimeError", "[ring] connection to a peer was lost"),
    ("group-connect", "RuntimeError", "[ring] Couldn't connect (error: 60)"),
    ("group-connect", "RuntimeError", "[jaccl] Couldn't connect (error: 65)"),
    ("broken-pipe", "BrokenPipeError", "[Errno 32] Broken pipe"),
]

# (class, text): what stderr, a crash report or a kernel log shows.
TEXTS = [
    # mlx <= 0.31: the abort form (mlx PR #479; vegaluisjose/mlx-rag #5)
    ("metal-oom",
     "libc++abi: terminating due to uncaught exception of type std::runtime_error: [METAL] "
     "Command buffer execution failed: Insufficient Memory "
     "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)\n"
     "zsh: abort      python3 create_vdb.py --pdf flash_attention.pdf --vdb vdb.npz\n"),
    # macOS unified log (ddalcu/mlx-serve #321)
    ("metal-oom",
     "IOGPUMetalError\nExecution of the command buffer was aborted due to an error during "
     "execution. Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)\n"),
    ("gpu-invalid-resource",
     "libc++abi: terminating due to uncaught exception of type std::runtime_error: [METAL] "
     "Command buffer execution failed: Invalid Resource "
     "(00000009:kIOGPUCommandBufferCallbackErrorInvalidResource)\n"),
    # every later command buffer (flutter #155538, the same Apple text)
    ("gpu-penalty-box",
     "Execution of the command buffer was aborted due to an error during execution. Ignored "
     "(for causing prior/excessive GPU errors) "
     "(00000004:kIOGPUCommandBufferCallbackErrorSubmissionsIgnored)\n" * 3),
    # mlx-lm #1505 / #1513: the 0.31.3 traceback, byte-identical four times
    ("metal-buffer-count",
     "Exception in thread Thread-1 (_generate):\nTraceback (most recent call last):\n"
     '  File ".../mlx_lm/server.py", line 853, in _generate\n'
     "    prompt_responses, gen_responses = batch_generator.next()\n"
     '  File ".../mlx_lm/generate.py", line 1855, in next\n    return self._next()\n'
     '  File ".../mlx_lm/generate.py", line 1451, in _step\n    mx.async_eval(*arrays)\n'
     "RuntimeError: [metal::malloc] Resource limit (499000) exceeded.\n"),
    # field notes: the extend crash on stock 0.31.3
    ("extend",
     "Exception in thread Thread-1 (_generate):\nTraceback (most recent call last):\n"
     '  File ".../mlx_lm/generate.py", line 1346, in _step\n'
     "    for processor in self.logits_processors[e]:\n"
     "TypeError: 'NoneType' object is not iterable\n"),
    # the shim's death line
    ("slice",
     "mlx-hotfix: generation thread died: ValueError: Slice indices must be 32-bit "
     "integers.; exiting 70\n"),
    ("broadcast",
     "ValueError: [broadcast_shapes] Shapes (1,8,1,16) and (1,8,1,0) cannot be broadcast.\n"),
    ("extract",
     "Traceback (most recent call last):\n"
     '  File ".../mlx_lm/generate.py", line 1780, in _next\n'
     "    caches = self.extract_cache(uids)\n"
     "IndexError: list index out of range\n"),
    ("config-missing-parameters",
     "2026-12-01 00:34:57,581 - ERROR - mlx_lm.server generation thread died: Missing 9 "
     "parameters: \nmodel.layers.2.input_layernorm.weight.\nTraceback (most recent call last):\n"
     "ValueError: Missing 9 parameters: \nmodel.layers.2.input_layernorm.weight.\n"),
    ("config-bad-pair",
     "RuntimeError: There is no Stream(cpu, 0) in current thread.\n"),
    # mlx #3862: the ring on mlx <= 0.32.0, then a silent wedge
    ("ring-abort",
     "[ring] Receiving from socket 51 failed with errno 54\n" * 10
     + "[ring] Too many send/recv errors. Aborting...\n"),
    ("jaccl-rdma-missing",
     "Exception Type:  EXC_BAD_ACCESS (SIGSEGV)\nThread 0 Crashed:\n"
     "0   libibverbs.dylib  ibv_reg_mr_iova2 + 40\n"
     "1   libjaccl.dylib    jaccl::SharedBuffer::register_to_protection_domain\n"),
    # mlx #4192: both ranks, after a cable was pulled
    ("jaccl-link-lost",
     "EXC_BAD_ACCESS  SIGSEGV  KERN_INVALID_ADDRESS at 0x0000000104ac4008\n"
     "libthunderboltrdma.dylib  tbt_post_recv\nlibthunderboltrdma.dylib  tbt_post_recv\n"
     "jaccl::Connection::post_recv(jaccl::SharedBuffer const&, unsigned long long)\n"),
    # panic reports (mlx #3346, jundot/omlx #862, mlx #3186, #3267)
    ("kernel-panic",
     'panic(cpu 7 caller 0xfffffe004418be28): "completeMemory() prepare count underflow" '
     "@IOGPUMemory.cpp:550\nDebugger message: panic\nOS version: 25E246\n"),
    ("kernel-panic",
     'panic(cpu 0): "IOGPUGroupMemory::remove_memory_object() memory object not found" '
     "@IOGPUGroupMemory.cpp:323\n"),
    ("kernel-panic",
     "panic(cpu 3 caller 0xfffffe001c5a3f50): watchdog timeout: no checkins from watchdogd "
     "in 90 seconds (25 total checkins since monitoring last enabled)\n"),
    # a JetsamEvent report's body (omlx #702; Apple's jetsam event reports)
    ("jetsam",
     '{"bug_type":"298","timestamp":"2026-04-10 05:05:26.00 +0000","os_version":"macOS '
     '26.4 (25E246)","incident_id":"5C0F1B2E-1F3A-4C55-9E0A-1D2B3C4D5E6F"}\n{\n'
     '  "largestProcess" : "Python",\n  "processes" : [\n    {\n      "name" : "Python",\n'
     '      "pid" : 41234,\n      "reason" : "vm-compressor-space-shortage",\n'
     '      "rpages" : 40265318\n    }\n  ]\n}\n'),
    ("broken-pipe",
     '  File ".../mlx_lm/server.py", line 1489, in handle_completion\n'
     '    self.wfile.write(f"data: {json.dumps(resp)}\\n\\n".encode())\n'
     "BrokenPipeError: [Errno 32] Broken pipe\n"),
    # jundot/omlx #1548: the .ips of an mlx <= 0.31 Metal abort, no message in it
    ("metal-abort",
     "Exception Type:    EXC_CRASH (SIGABRT)\nTermination Reason:  Namespace SIGNAL, Code 6, "
     "Abort trap: 6\nApplication Specific Information:\nabort() called\n\n"
     "Thread 35 Crashed::  Dispatch queue: com.Metal.CompletionQueueDispatch\n"
     "0   libsystem_kernel.dylib  0x19040a5e8 __pthread_kill + 8\n"
     "9   libmlx.dylib  mlx::core::gpu::check_error(MTL::CommandBuffer*) + 96\n"),
    ("metal-error",
     "RuntimeError: [METAL] Command buffer execution failed: Page Fault "
     "(00000005:kIOGPUCommandBufferCallbackErrorPageFault).\n"),
    ("native-abort",
     "libc++abi: terminating due to uncaught exception of type std::invalid_argument: "
     "[reshape] Cannot reshape array of size 12 into shape (5,3).\n"),
    # Linux mm/oom_kill.c (equinor/ert #7797, dmesg --time-format iso)
    ("killed",
     "2024-04-29T14:55:41,679685+02:00 oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),"
     "cpuset=/,mems_allowed=0,global_oom,task_memcg=/user.slice/user-21417.slice/"
     "user@21417.service,task=perl,pid=1440763,uid=21417\n"
     "2024-04-29T14:55:41,679700+02:00 Out of memory: Killed process 1440763 (perl) "
     "total-vm:87033376kB, anon-rss:60356340kB, file-rss:0kB, shmem-rss:0kB, UID:21417 "
     "pgtables:169956kB oom_score_adj:0\n"),
    ("killed", "\x1b[33m[WARN] Node with rank 1 was killed \x1b[0m\n"),
]

# (text, the class it must NOT be): one near miss per class.
NEAR_MISSES = [
    (("FileNotFoundError", "[Errno 2] No such file or directory: '/tmp/prompt-cache.bin'"),
     "config-model-path"),
    (("LocalEntryNotFoundError",
      "Got: ConnectError: [Errno 8] nodename nor servname provided\nAn error happened while "
      "trying to locate the files on the Hub, and we cannot find the appropriate snapshot "
      "folder for the specified revision on the local disk. Please check your internet "
      "connection and try again."), "config-model-path"),
    (("KeyError", "'Model type qwen9_moe not supported.'"), "config-model-type"),
    (("TypeError", "Missing 3 parameters for call to foo()"), "config-missing-parameters"),
    (("RuntimeError", "There is no Stream(gpu, 0) in the list"), "config-bad-pair"),
    (("TimeoutError", "timed out waiting for the GPU"), "gpu-timeout"),
    (("RuntimeError", "[METAL] Command buffer execution failed: Caused GPU Timeout Error "
      "(00000002:kIOGPUCommandBufferCallbackErrorTimeout)."), "gpu-penalty-box"),
    (("RuntimeError", "[metal::malloc] invalid resource options"), "gpu-invalid-resource"),
    (("MemoryError", ""), "metal-oom"),
    (("RuntimeError", "[metal::malloc] Resource limit exceeded while loading"),
     "metal-buffer-count"),
    (("RuntimeError", "[metal::malloc] Attempting to allocate 0 bytes"), "metal-too-big"),
    (("RuntimeError", "[malloc] Unable to allocate memory."), "alloc-fail"),
    (("ValueError", "'NoneType' object is not iterable"), "extend"),
    (("TypeError", "'NoneType' object is not subscriptable"), "extend"),
    (("ValueError", "Slice indices must be integers or None"), "slice"),
    (("ValueError", "[concatenate] All the input array dimensions must match exactly except "
      "for the concatenation axis."), "broadcast"),
    (("IndexError", "list index out of range"), "extract"),
    (("RuntimeError", "[jaccl] Changing queue pair to RTR failed with errno 96"), "jaccl-no-gid"),
    (("RuntimeError", "[jaccl] Creating the queue pair failed with errno 16. Thunderbolt RDMA "
      "devices support a limited number of queue pairs per device"), "jaccl-stale-rdma"),
    (("RuntimeError", "[jaccl] Register memory region failed"), "jaccl-rdma-missing"),
    (("RuntimeError", "[jaccl] Recv failed with error code 5"), "jaccl-peer-lost"),
    (("RuntimeError", "[ring] Rank 1 has no sockets to the left."), "ring-peer-lost"),
    (("RuntimeError", "[ring] Group split not supported."), "ring-abort"),
    (("RuntimeError", "[ring] Couldn't create socket (error: 24)"), "group-connect"),
    (("ConnectionResetError", "[Errno 54] Connection reset by peer"), "broken-pipe"),
    (("RuntimeError", "[Errno 32] Broken pipe"), "broken-pipe"),
]

# near misses in text form (classify_text)
TEXT_NEAR_MISSES = [
    # the word alone, not a traceback's last line
    ("the client said 'NoneType' object is not iterable\n", "extend"),
    ("a thread on the queue com.Metal.CompletionQueueDispatch\n", "metal-abort"),
    ("panic(cpu 2 caller 0xfffffe0012345678): Kernel data abort.\n", "kernel-panic"),
    ('{"bug_type":"309","procName":"Python","largestProcessName":"x"}\n', "jetsam"),
    ("[ring] Receiving from socket 51 failed with errno 54\n", "ring-abort"),
    ("Node with rank 1 completed\n", "killed"),
    ("oom_reaper: reaped process 4242 (python3), now anon-rss:0kB, file-rss:0kB\n", "killed"),
    ("libthunderbolt: link up on tbt_port 2\n", "jaccl-link-lost"),
    ("BrokenPipeError handled: client went away\n", "broken-pipe"),
    ("RuntimeError: [ring] Too many open files\n", "ring-peer-lost"),
    ("libc++abi: an exception was caught\n", "native-abort"),
    ("[METAL] Command buffer execution succeeded\n", "metal-error"),
]


def _cls(match):
    return match.cls


@pytest.mark.parametrize("cls, exc_type, message", EXCEPTIONS)
def test_each_exception_class_on_its_real_text(cls, exc_type, message):
    assert _cls(signatures.classify(exc_type, message)) == cls


@pytest.mark.parametrize("cls, text", TEXTS)
def test_each_stderr_class_on_its_real_text(cls, text):
    assert _cls(signatures.classify_text(text)) == cls


@pytest.mark.parametrize("cls, exc_type, message", EXCEPTIONS)
def test_a_traceback_last_line_in_stderr_gives_the_same_class(cls, exc_type, message):
    # What the stock server prints for the same exception (a library's own
    # exceptions print with their module).
    hub = {"HFValidationError", "LocalEntryNotFoundError", "RepositoryNotFoundError"}
    module = "huggingface_hub.errors." if exc_type in hub else ""
    text = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
            f"{module}{exc_type}: {message}\n")
    assert _cls(signatures.classify_text(text)) == cls


@pytest.mark.parametrize("case, not_cls", NEAR_MISSES)
def test_near_misses_are_not_the_class(case, not_cls):
    assert _cls(signatures.classify(*case)) != not_cls


@pytest.mark.parametrize("text, not_cls", TEXT_NEAR_MISSES)
def test_text_near_misses_are_not_the_class(text, not_cls):
    assert _cls(signatures.classify_text(text)) != not_cls


def test_every_class_has_a_real_text_and_a_near_miss():
    classes = {sig.cls for sig in T.TABLE}
    tested = {c for c, *_ in EXCEPTIONS} | {c for c, _ in TEXTS}
    missed = {c for _, c in NEAR_MISSES} | {c for _, c in TEXT_NEAR_MISSES}
    assert classes - tested == set(), "classes with no test on their real text"
    assert classes - missed == set(), "classes with no near-miss test"
    assert tested <= classes and missed <= classes


def test_the_classes_the_issue_names_are_in_the_table():
    for cls in ("metal-buffer-count", "metal-too-big", "alloc-fail", "metal-oom", "gpu-timeout",
                "gpu-penalty-box", "gpu-invalid-resource", "metal-abort", "extend",
                "config-bad-pair", "config-missing-parameters", "config-model-path",
                "ring-abort", "ring-peer-lost", "broken-pipe", "jetsam", "killed",
                "kernel-panic", "slice", "broadcast", "extract"):
        assert cls in T.BY_CLASS, cls
    assert any(cls.startswith("jaccl-") for cls in T.BY_CLASS)


def test_the_entries_are_well_formed():
    names = [sig.cls for sig in T.TABLE]
    assert len(names) == len(set(names))
    for sig in T.TABLE + (T.UNKNOWN_ENTRY,):
        assert re.fullmatch(r"[a-z]+(-[a-z]+)*", sig.cls), sig.cls
        assert sig.title and "\n" not in sig.title
        assert sig.remedy and "\n" not in sig.remedy and len(sig.remedy) <= 200, sig.cls
        assert sig.source, sig.cls
        if sig.config:
            assert not sig.restart_helps, sig.cls  # the same failure after every restart
            # A configuration class names what to change: a flag, a pin or a command.
            assert re.search(r"--[a-z]|pip install|ifconfig|reboot|rdma_ctl", sig.remedy), sig.cls
        if sig.gpu_fault:
            assert sig.restart_helps, sig.cls  # a new process is the cure
    assert T.UNKNOWN_ENTRY.restart_helps and not T.UNKNOWN_ENTRY.patterns


def test_gpu_faults_are_the_gpu_classes_and_thread_killers_are_not():
    gpu = {sig.cls for sig in T.TABLE if sig.gpu_fault}
    assert {"gpu-timeout", "gpu-penalty-box", "gpu-invalid-resource", "metal-oom"} <= gpu
    for cls in ("extend", "slice", "broadcast", "extract", "metal-buffer-count",
                "metal-too-big", "alloc-fail", "broken-pipe"):
        assert cls not in gpu, cls


def test_the_bad_pair_remedy_is_the_pairings_fix():
    spec = importlib.util.spec_from_file_location(
        "pairings_for_test", SHIM_DIR / "mlx_hotfix" / "pairings.py")
    pairings = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pairings)
    stream_row = next(row for row in pairings.BAD_PAIRS if "Stream(cpu, 0)" in row[5])
    fix = stream_row[6].replace("pip install ", "")
    assert fix in T.entry("config-bad-pair").remedy


def test_the_first_matching_entry_wins():
    # An mlx <= 0.31 .ips of a GPU timeout: the abort frames and the message.
    ips = ("Thread 35 Crashed::  Dispatch queue: com.Metal.CompletionQueueDispatch\n"
           "9   libmlx.dylib  mlx::core::gpu::check_error(MTL::CommandBuffer*) + 96\n"
           "libc++abi: terminating due to uncaught exception of type std::runtime_error: "
           "[METAL] Command buffer execution failed: Caused GPU Timeout Error "
           "(00000002:kIOGPUCommandBufferCallbackErrorTimeout)\n")
    assert _cls(signatures.classify_text(ips)) == "gpu-timeout"
    # The timeout, then every later command buffer ignored: the timeout is the cause.
    log = ("RuntimeError: [METAL] Command buffer execution failed: Ignored (for causing "
           "prior/excessive GPU errors) (00000004:kIOGPUCommandBufferCallbackErrorSubmissionsIgnored)\n"
           "earlier: Caused GPU Timeout Error (00000002:kIOGPUCommandBufferCallbackErrorTimeout)\n")
    assert _cls(signatures.classify_text(log)) == "gpu-timeout"
    # A Metal buffer-count message in the libc++abi abort (mlx <= 0.31) is the count.
    abort = ("libc++abi: terminating due to uncaught exception of type std::runtime_error: "
             "[metal::malloc] Resource limit (499000) exceeded.\n")
    assert _cls(signatures.classify_text(abort)) == "metal-buffer-count"


def test_detail_from_the_message():
    assert signatures.classify(
        "RuntimeError", "[metal::malloc] Resource limit (499000) exceeded.").detail == {
            "limit": 499000}
    assert signatures.classify(
        "RuntimeError", "[metal::malloc] Attempting to allocate 34359738368 bytes which is "
        "greater than the maximum allowed buffer size of 22906503168 bytes.").detail == {
            "bytes": 34359738368, "max_bytes": 22906503168}
    assert signatures.classify(
        "HFValidationError", "Repo id must be in the form 'repo_name' or "
        "'namespace/repo_name': '/srv/models/x'. Use `repo_type` argument if needed."
    ).detail == {"model": "/srv/models/x"}
    url = signatures.classify(
        "RepositoryNotFoundError",
        "404 Client Error.\n\nRepository Not Found for url: https://huggingface.co/api/models/a/b."
        "\nPlease make sure").detail["url"]
    assert url == "https://huggingface.co/api/models/a/b"
    assert signatures.classify("ValueError", "Missing 627 parameters: \nx.").detail == {
        "missing": 627}
    assert signatures.classify("RuntimeError", "[jaccl] Recv failed with errno=2").detail == {
        "errno": 2}


def test_the_extract_class_looks_in_the_traceback():
    trace = ('  File ".../mlx_lm/generate.py", line 1780, in _next\n'
             "    caches = self.extract_cache(uids)\n")
    assert signatures.classify("IndexError", "list index out of range", trace).cls == "extract"
    assert signatures.classify("IndexError", "list index out of range").cls == T.UNKNOWN
    # Only that entry looks there: a traceback through _step is not extend.
    assert signatures.classify(
        "ValueError", "shape mismatch",
        "    for processor in self.logits_processors[e]:\n").cls == T.UNKNOWN


def test_ring_abort_names_the_socket_and_errno_and_the_failed_rank():
    text = ("\x1b[33m[WARN] Node with rank 2 exited with code 1 \x1b[0m\n"
            + "[ring] Receiving from socket 51 failed with errno 54\n" * 10
            + "[ring] Too many send/recv errors. Aborting...\n")
    match = signatures.classify_text(text)
    assert match.cls == "ring-abort"
    assert match.detail == {"fd": 51, "errno": 54, "failed_rank": 2, "failed_exit_code": 1}


def test_unknown_is_a_class_never_an_error():
    for args in ((None, None), ("", ""), ("ValueError", "something new"), (b"x", b"y"),
                 ("RuntimeError", "x" * 100000)):
        assert signatures.classify(*args).cls == "unknown"
    for text in (None, "", "all is well\n", 12345):
        assert signatures.classify_text(text).cls == "unknown"

    class Unprintable:
        def __str__(self):
            raise RuntimeError("no")

    assert signatures.classify("ValueError", Unprintable()).cls == "unknown"
    assert signatures.classify_text(Unprintable()).cls == "unknown"
    match = signatures.classify("ValueError", "something new")
    assert not match.known and match.as_dict()["remedy"] == T.UNKNOWN_ENTRY.remedy


def test_as_dict_carries_the_cause_and_remedy_for_reports():
    got = signatures.classify("RuntimeError", "[ring] connection to a peer was lost").as_dict()
    assert got["cause"] == "ring-peer-lost" and got["remedy"] == T.entry("ring-peer-lost").remedy
    assert got["restart_helps"] is True and got["gpu_fault"] is False and got["config"] is False
    assert got["detail"] == {}


# -- recorded stderr ---------------------------------------------------------------


@pytest.mark.parametrize("name, cls, detail", [
    ("stock-0.31.3-missing-parameters.txt", "config-missing-parameters", {"missing": 9}),
    ("stock-0.32.2-missing-parameters.txt", "config-missing-parameters", {"missing": 9}),
    ("stock-0.31.3-model-path.txt", "config-model-path", {"model": "/nonexistent/model-dir"}),
    ("stock-0.32.2-model-path.txt", "config-model-path", {"model": "/nonexistent/model-dir"}),
    ("ring-peer-lost-mlx-0.32.4.txt", "ring-peer-lost",
     {"failed_rank": 1, "failed_exit_code": 3, "fd": 3}),
    ("kmsg-memcg-oom-linux-6.18.txt", "killed",
     {"pid": 5598, "process": "python3", "total_vm_kb": 75160, "anon_rss_kb": 65280}),
    ("dmesg-memcg-oom-linux-6.18.txt", "killed",
     {"pid": 5598, "process": "python3", "total_vm_kb": 75160, "anon_rss_kb": 65280}),
])
def test_recorded_stderr(name, cls, detail):
    match = signatures.classify_text((DATA / name).read_text())
    assert (match.cls, match.detail) == (cls, detail)


# -- what the watchdog adds ---------------------------------------------------------


def test_group_failure_names_the_failed_rank_and_host_from_the_launcher():
    text = (DATA / "ring-peer-lost-mlx-0.32.4.txt").read_text()
    match = signatures.group_failure(text, ["10.0.0.1", "10.0.0.2"])
    assert match.cls == "ring-peer-lost"
    assert match.detail["failed_rank"] == 1 and match.detail["failed_host"] == "10.0.0.2"


def test_group_failure_from_the_survivors_own_lines():
    # Three ranks; ranks 0 and 2 report the peer lost; rank 1 said nothing.
    text = ("mlx-hotfix: [rank 0 on studio-1] generation thread died: RuntimeError: [ring] "
            "connection to a peer was lost; exiting 70\n"
            "mlx-hotfix: [rank 2 on studio-3] generation thread died: RuntimeError: [ring] "
            "connection to a peer was lost; exiting 70\n")
    match = signatures.group_failure(text, ["studio-1", "studio-2", "studio-3"])
    assert match.cls == "ring-peer-lost"
    assert match.detail == {"rank": 0, "host": "studio-1", "reported_by": [0, 2],
                            "failed_rank": 1, "failed_host": "studio-2"}
    # Without the hosts, what the lines say and no more.
    assert signatures.group_failure(text).detail == {"rank": 0, "host": "studio-1",
                                                     "reported_by": [0, 2]}


def test_group_failure_leaves_other_classes_alone():
    match = signatures.group_failure("RuntimeError: [metal::malloc] Resource limit (499000) "
                                     "exceeded.\n", ["a", "b"])
    assert match.cls == "metal-buffer-count" and match.detail == {"limit": 499000}


def test_classify_exit():
    # A SIGKILL with nothing said: killed, with the OOM killer's record when found.
    assert signatures.classify_exit(-9).cls == "killed"
    match = signatures.classify_exit(137, oom={"by": "oom-killer", "pid": 42})
    assert (match.cls, match.detail) == ("killed", {"exit_code": 137, "signal": 9,
                                                    "by": "oom-killer", "pid": 42})
    # What the process left says more than its exit code.
    jetsam = '{\n  "largestProcess" : "Python",\n  "reason" : "vm-compressor-space-shortage"\n}'
    match = signatures.classify_exit(-9, texts=[None, "", jetsam])
    assert match.cls == "jetsam"
    assert match.detail == {"largest_process": "Python", "reason": "vm-compressor-space-shortage",
                            "exit_code": -9}
    # Any other exit with nothing said is unknown, with what is known.
    assert signatures.classify_exit(1).cls == "unknown"
    assert signatures.classify_exit(-6).detail == {"exit_code": -6, "signal": 6}
    assert signatures.classify_exit(None).detail == {"exit_code": None}


def test_restart_cannot_fix():
    assert signatures.restart_cannot_fix("config-missing-parameters")
    assert signatures.restart_cannot_fix("jaccl-stale-rdma")
    for cls in ("gpu-timeout", "extend", "unknown", "no-such-class", None, ""):
        assert not signatures.restart_cannot_fix(cls), cls


def test_the_harness_faults_raise_the_real_texts():
    """The fault injector's messages (harness/faults) are the table's texts:
    a test that injects a kind sees the class a real failure would have."""
    path = Path(__file__).parent.parent / "harness" / "faults" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("faults_for_test", path)
    faults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(faults)  # with no MLX_TEST_* set it installs nothing
    expected = {"typeerror": "extend", "resource": "metal-buffer-count", "slice": "slice",
                "broadcast": "broadcast", "extract": "extract", "gputimeout": "gpu-timeout",
                "penaltybox": "gpu-penalty-box", "invalidresource": "gpu-invalid-resource",
                "metaloom": "metal-oom", "ringlost": "ring-peer-lost"}
    # "quoted" raises the text a test gives it (MLX_TEST_FAULT_MESSAGE): no class of its own.
    assert set(faults._MESSAGES) - {"quoted"} == set(expected)
    for kind, (error, message) in faults._MESSAGES.items():
        if kind == "quoted":
            continue
        assert signatures.classify(error.__name__, message).cls == expected[kind], kind


# -- the operator's guide ------------------------------------------------------------------


def test_the_operator_guide_lists_every_class_from_the_table():
    text = OPERATOR_GUIDE.read_text()
    begin, end = "<!-- death-classes:begin -->\n", "<!-- death-classes:end -->"
    assert begin in text and end in text
    block = text.split(begin, 1)[1].split(end, 1)[0]
    expected = signatures.markdown_table()
    assert block.strip() == expected.strip(), (
        "docs/operator.md's table of death classes is out of date; replace the block between the "
        "death-classes markers with:\n\n" + expected)
