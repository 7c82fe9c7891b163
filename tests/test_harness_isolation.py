"""The suite never writes into the user's report folder (issue 18, item 6).

conftest points the user's default report folder (XDG_STATE_HOME, or HOME on
macOS) at a stand-in for the whole session and checks at its end that
nothing appeared there; these tests check each way a test starts a process.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from harness.server import SHIM_DIR, python_for, run_python
from tests.conftest import user_report_dirs


def _leaks(stand_in):
    return [p for p in user_report_dirs(stand_in / "state", stand_in / "home") if p.exists()]


@pytest.mark.server
def test_every_process_a_test_starts_reports_into_a_folder_of_its_own(
        servers, tiny_llama, user_folder_stand_in):
    # A harness helper (base_env): its own scratch folder.
    assert run_python("0.31.3", "import mlx_lm.server").returncode == 0
    # A process started with the test's own os.environ: the session folder.
    inherited = subprocess.run(
        [str(python_for("0.31.3")), "-c", "import mlx_lm.server"],
        env=dict(os.environ, PYTHONPATH=str(SHIM_DIR)), capture_output=True, text=True,
        timeout=120)
    assert inherited.returncode == 0, inherited.stderr
    # A stock server: a report folder and heartbeat file next to its log.
    server = servers("0.31.3", tiny_llama)
    server.warm_up()
    assert (server.report_dir / f"stacks-{server.proc.pid}.txt").exists(), server.log()
    assert server.heartbeat_file and os.path.exists(server.heartbeat_file)
    assert _leaks(user_folder_stand_in) == []
