"""Shared fixtures: tiny generated models and real stock servers.

Nothing is downloaded. The models are built once per session with random
weights; each tested mlx-lm release runs in its own venv (scripts/setup-envs).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import FAULTS_DIR
from harness import server as server_support
from harness.server import VERSIONS, StockServer, python_for



@pytest.fixture(scope="session", autouse=True)
def _offline():
    os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def envs():
    """Fail loudly, never skip, when a tested release's venv is missing."""
    try:
        return {v: python_for(v) for v in VERSIONS}
    except server_support.MissingEnvironment as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from harness.tinymodel import build_llama

    return build_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory):
    from harness.tinymodel import build_qwen3_next

    return build_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next"))


@pytest.fixture
def servers(tmp_path, envs):
    """Start stock servers; every one is killed at the end of the test."""
    started = []

    def start(version, model, **kwargs) -> StockServer:
        server = StockServer(version, model, tmp_path, **kwargs)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


def fault_env(spec: str, arm_file: Path | None = None, *, shim: bool = True) -> dict:
    """PYTHONPATH and variables that inject one fault (harness/faults)."""
    path = ([str(server_support.SHIM_DIR)] if shim else []) + [str(FAULTS_DIR)]
    env = {"PYTHONPATH": os.pathsep.join(path), "MLX_TEST_FAULT": spec}
    if arm_file is not None:
        env["MLX_TEST_FAULT_ARM_FILE"] = str(arm_file)
    return env


def arm_fault(arm_file: Path, kind: str = "") -> None:
    """Arm a fault; with MLX_TEST_FAULT=raise:armed:..., the kind it raises.
    Written whole, then renamed: the server never reads a half-written file."""
    part = arm_file.with_name(arm_file.name + ".part")
    part.write_text(kind)
    os.replace(part, arm_file)


@pytest.fixture(scope="session")
def second_host(tmp_path_factory):
    """A second host on this machine over a real sshd (harness/remotehost.py),
    shared by the session; stopped with everything that ran there."""
    from harness.remotehost import SecondHost, SecondHostUnavailable

    host = SecondHost(tmp_path_factory.mktemp("second-host"))
    try:
        host.start()
    except SecondHostUnavailable as exc:
        host.stop()
        if os.environ.get("CI") == "true":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    try:
        yield host
    finally:
        host.stop()
