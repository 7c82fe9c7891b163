"""The test and bench harness: real stock servers, fakes, faults (not shipped).

Used by tests/, bench/ and scripts/demo.py; nothing in the shipped packages
(sitecustomize/, watchdog/) imports it. Imports go one way: harness -> the
shipped code, never back. The repository root is importable: pytest has
``pythonpath = ["."]``, and the bench and demo scripts run as modules from
the root (``python -m bench.throughput``, ``python -m scripts.demo``).

    server.py        StockServer (a real stock mlx_lm.server in a venv), env helpers
    watchdog_run.py  WatchdogProcess (mlx-watchdog supervise/watch in its own group)
    procs.py         kill_group (the one process-group kill) and chat (the one request)
    fakes.py         in-process fakes for unit tests: Clock, FakeProcess, ...
    fakeserver.py    a tiny HTTP server that answers like mlx_lm.server (a script too)
    tinymodel.py     tiny random-weight models on disk (no hub download)
    repro.py         the upstream two-request ``extend`` crash
    advance_probe.py measures ArraysCache.advance, stock or patched (a script)
    extract_probe.py measures ArraysCache.extract, stock or patched (a script)
    haproxy.py       a real haproxy in front of the server (health-check tests)
    remotehost.py    a second host over a real sshd on 127.0.0.2 (group tests, bench)
    faults/          the fault injector: a sitecustomize folder for PYTHONPATH
"""

from pathlib import Path

HARNESS_DIR = Path(__file__).resolve().parent
ROOT = HARNESS_DIR.parent
SHIM_DIR = ROOT / "sitecustomize"
FAULTS_DIR = HARNESS_DIR / "faults"
FAKE_SERVER = HARNESS_DIR / "fakeserver.py"
TINYMODEL = HARNESS_DIR / "tinymodel.py"
ADVANCE_PROBE = HARNESS_DIR / "advance_probe.py"
