"""mlx-watchdog doctor, run against real envs (the shim's registry runs there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.server import SHIM_DIR, free_port, python_for


def _doctor(python, *args, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "MLX_HOTFIX"))}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env["XDG_STATE_HOME"] = os.environ.get("PYTEST_TMP_STATE", "/tmp/mlx-doctor-test-state")
    return subprocess.run([sys.executable, "-m", "mlx_watchdog", "doctor", "--python", str(python),
                           "--port", str(free_port()), *args],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.matrix
def test_doctor_names_the_known_bad_pair_and_the_missing_shim():
    run = _doctor(python_for("0.31.0+mlx-0.32.4"))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "PROBLEM: the shim is not on PYTHONPATH" in run.stdout
    assert ("PROBLEM: mlx-lm 0.31.0 with mlx 0.32.4: the generation thread dies on the first "
            "request") in run.stdout
    assert "fix: pip install 'mlx<0.32'" in run.stdout
    assert 'yanked from PyPI: "Batched KV cache cross contamination"' in run.stdout


def test_doctor_passes_a_good_env_with_the_shim():
    run = _doctor(python_for("0.31.3"), "--json", pythonpath=str(SHIM_DIR))
    report = json.loads(run.stdout)
    assert run.returncode == 0 and report["ok"], report
    assert report["mlx_lm"] == "0.31.3" and report["shim_on_pythonpath"]
    parts = report["parts"]
    assert all(parts[name] == "applied" for name in ("exit", "extend", "advance")), parts
    assert parts["recover"].startswith("off")  # opt-in


def test_pairing_table():
    sys.path.insert(0, str(SHIM_DIR))
    from mlx_hotfix import pairings

    assert pairings.warning_for("0.31.3", "0.32.4", "5.0.0") is None
    assert pairings.warning_for("0.31.2", "0.31.2", "5.0.0") is None
    assert "Stream(cpu, 0)" in pairings.warning_for("0.30.7", "0.32.4")
    assert "transformers<5" in pairings.warning_for("0.28.4", "0.31.2", "5.24.0")
    assert "yanked" in pairings.warning_for("0.31.0", "0.31.2")
