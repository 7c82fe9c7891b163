"""advance: the lazy graph behind ArraysCache (upstream #1641/#1845), on a
tiny random hybrid qwen3_next decoded through the real BatchGenerator.

Stock and patched runs of harness/advance_probe.py are compared: the
greedy tokens and every lengths/left_padding value must be identical, and the
stale graph must stay a few nodes deep instead of one node per step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.server import VERSIONS, run_probe, run_python

STEPS = 300


def probe(version: str, model: Path, *, patched: bool) -> dict:
    return run_probe(version, "advance_probe", str(model), str(STEPS), patched=patched)


@pytest.fixture(scope="module", params=VERSIONS)
def stock_and_patched(request, envs, tiny_qwen3_next):
    version = request.param
    return version, probe(version, tiny_qwen3_next, patched=False), probe(
        version, tiny_qwen3_next, patched=True)


def test_stock_grows_one_graph_node_per_step(stock_and_patched):
    _, stock, _ = stock_and_patched
    assert stock["stale_nodes"] >= STEPS


def test_patched_graph_stays_bounded(stock_and_patched):
    _, _, patched = stock_and_patched
    assert patched["stale_nodes"] <= 4


def test_greedy_tokens_are_identical(stock_and_patched):
    _, stock, patched = stock_and_patched
    assert len(stock["tokens"]) >= STEPS - 1
    assert patched["tokens"] == stock["tokens"]
    assert patched["batch_tokens"] == stock["batch_tokens"]
    assert patched["alone_tokens"] == stock["alone_tokens"]


def test_values_are_identical_through_every_cache_operation(stock_and_patched):
    # Identical tokens do not prove the fold: in plain decoding left_padding
    # only goes down from 0. So compare the values themselves, on a
    # left-padded batch, through filter/extend/extract/merge/state/file.
    _, stock, patched = stock_and_patched
    assert patched["values"] == stock["values"]
    assert stock["values"]["advance"]["left_padding"] == [0, -3, -2]


def test_the_gate_matches_the_installed_source(envs):
    code = ("import sys, mlx_lm.models.cache, mlx_hotfix.patches.advance as a; "
            "print(a.check_shape(sys.modules['mlx_lm.models.cache']))")
    for version in VERSIONS:
        result = run_python(version, code, env={"MLX_HOTFIX_DISABLE": "advance"})
        assert result.stdout.strip() == "None", (version, result.stderr)
