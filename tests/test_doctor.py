"""mlx-watchdog doctor, run against real envs (the shim's registry runs there)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from harness.server import SHIM_DIR, free_port, python_for


def _doctor(python, *args, pythonpath=None, path=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "MLX_HOTFIX"))}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    if path is not None:
        env["PATH"] = path
    env["XDG_STATE_HOME"] = os.environ.get("PYTEST_TMP_STATE", "/tmp/mlx-doctor-test-state")
    python_flag = ["--python", str(python)] if python is not None else []
    if "--port" not in args:
        args = ("--port", str(free_port()), *args)
    return subprocess.run([sys.executable, "-m", "mlx_watchdog", "doctor", *python_flag, *args],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.matrix
def test_doctor_names_the_known_bad_pair_and_the_missing_shim():
    run = _doctor(python_for("0.31.0+mlx-0.32.4"))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "  ! " in run.stdout and "not on this shell's PYTHONPATH" in run.stdout  # a warning
    assert ("  ✗ mlx-lm 0.31.0 with mlx 0.32.4: the generation thread dies on the first "
            "request") in run.stdout
    assert "      fix: pip install 'mlx<0.32'" in run.stdout
    assert 'yanked from PyPI: "Batched KV cache cross contamination"' in run.stdout


def test_doctor_passes_a_good_env_with_the_shim():
    run = _doctor(python_for("0.31.3"), "--json", pythonpath=str(SHIM_DIR))
    report = json.loads(run.stdout)
    assert run.returncode == 0 and report["ok"], report
    assert report["mlx_lm"] == "0.31.3" and report["shim_on_pythonpath"]
    parts = report["parts"]
    assert all(parts[name] == "applied" for name in ("exit", "extend", "advance")), parts
    assert parts["recover"].startswith("off")  # opt-in


def _checks(report, status):
    return [c["message"] for g in report["groups"] for c in g["checks"] if c["status"] == status]


def test_doctor_passes_the_recommended_setup_without_the_shim_on_pythonpath(tmp_path):
    # The shim is added by supervise/exec/install: its absence here is a
    # warning, not a failure. The default Python is the mlx_lm.server on PATH's.
    bin_dir = python_for("0.32.2").parent
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run = _doctor(None, "--json", "--model", str(model),
                  path=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    report = json.loads(run.stdout)
    assert run.returncode == 0 and report["ok"], _checks(report, "fail")
    assert report["python"] == str(bin_dir / "python") and report["mlx_lm"] == "0.32.2"
    assert any("not on this shell's PYTHONPATH" in m for m in _checks(report, "warn"))
    assert f"{model} (config.json found)" in _checks(report, "ok")
    text = _doctor(None, "--model", str(model), "--no-color",
                   path=f"{bin_dir}{os.pathsep}{os.environ['PATH']}").stdout
    assert "\nServer Python\n  ✓ " in "\n" + text and "mlx-lm 0.32.2" in text
    assert text.rstrip().splitlines()[-1].startswith("no problems; read the warnings (")
    assert "mlx-lm None" not in text


def test_doctor_names_each_problem_with_its_fix(tmp_path):
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = _doctor("/bin/true", "--host", "::1", "--port", str(port),
                      "--model", str(tmp_path / "missing"), "--no-color")
    out = run.stdout
    assert run.returncode == 1
    assert "✗ cannot inspect /bin/true: it printed nothing and exited 0" in out
    assert f"✗ {tmp_path / 'missing'}: no such file or directory" in out
    assert f"✗ [::1]:{port}: {port} is already in use on ::1" in out
    # Every problem is followed by its fix.
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  ✗ "):
            assert lines[i + 1].startswith("      fix: "), lines[i:i + 2]
    assert lines[-1].startswith("3 problem(s) to fix before a server runs here")


def test_doctor_calls_a_free_ipv6_port_free():
    # Issue 18: AF_INET only, doctor called every --host ::1 port taken.
    run = _doctor("/bin/true", "--host", "::1", "--json")
    report = json.loads(run.stdout)
    network = [g for g in report["groups"] if g["title"] == "Network"][0]["checks"]
    assert network[0]["status"] == "ok" and network[0]["message"].endswith("is free"), network


def test_pairing_table():
    sys.path.insert(0, str(SHIM_DIR))
    from mlx_hotfix import pairings

    assert pairings.warning_for("0.31.3", "0.32.4", "5.0.0") is None
    assert pairings.warning_for("0.31.2", "0.31.2", "5.0.0") is None
    assert "Stream(cpu, 0)" in pairings.warning_for("0.30.7", "0.32.4")
    assert "transformers<5" in pairings.warning_for("0.28.4", "0.31.2", "5.24.0")
    assert "yanked" in pairings.warning_for("0.31.0", "0.31.2")


def test_doctor_turns_a_known_bad_pair_into_problems_with_fixes(tmp_path):
    # The matrix test runs the real 0.31.0 + mlx 0.32.4 env; this stand-in
    # interpreter answers the inspection the same way, for every run.
    fake = tmp_path / "python"
    found = {"python": str(fake), "mlx-lm": "0.31.0", "mlx": "0.32.4", "transformers": "5.0.0",
             "parts": {"exit": "applied"}}
    fake.write_text("#!/bin/sh\necho 'MLX-DOCTOR " + json.dumps(found) + "'\n")
    fake.chmod(0o755)
    run = _doctor(fake, "--no-color")
    assert run.returncode == 1, run.stdout
    assert ("  ✗ mlx-lm 0.31.0 with mlx 0.32.4: the generation thread dies on the first "
            "request") in run.stdout
    assert "      fix: pip install 'mlx<0.32'" in run.stdout
    assert 'yanked from PyPI: "Batched KV cache cross contamination"' in run.stdout
    assert "      fix: use another release" in run.stdout
