"""extract: ArraysCache.extract keeps the whole batch alive (upstream #1701),
on a tiny random hybrid qwen3_next decoded in a batch of 8 through the real
BatchGenerator (harness/extract_probe.py), stock and patched.

Stock: one sequence extracted (as the server does for the prompt cache),
the generator and its batch dropped, and MLX still holds the linear layers'
state of all 8 sequences, while the extracted cache's ``nbytes`` (what the
prompt cache counts) says one. Patched: it holds what it counts, and the
extracted values and the tokens decoded on from them are identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.server import VERSIONS, run_probe, run_python


def probe(version: str, model: Path, *, patched: bool) -> dict:
    return run_probe(version, "extract_probe", str(model), patched=patched)


@pytest.fixture(scope="module", params=VERSIONS)
def stock_and_patched(request, envs, tiny_qwen3_next):
    version = request.param
    return version, probe(version, tiny_qwen3_next, patched=False), probe(
        version, tiny_qwen3_next, patched=True)


def test_stock_holds_the_whole_batch_for_one_extracted_sequence(stock_and_patched):
    _, stock, _ = stock_and_patched
    assert stock["linear_batch"] == 8 * stock["linear_counted"]
    # The batch is dropped, yet its linear state is all still there.
    assert stock["held_bytes"] >= stock["linear_batch"]
    assert stock["held_bytes"] > 4 * stock["counted_bytes"]


def test_patched_holds_what_the_prompt_cache_counts(stock_and_patched):
    _, _, patched = stock_and_patched
    assert patched["held_bytes"] < patched["linear_batch"]
    # At most a few bytes of bookkeeping over the count, never another state.
    assert patched["held_bytes"] < patched["counted_bytes"] + patched["linear_counted"]


def test_values_and_tokens_are_identical(stock_and_patched):
    _, stock, patched = stock_and_patched
    assert len(stock["tokens"]) == 8 and stock["values"]
    assert patched["values"] == stock["values"]
    assert patched["tokens"] == stock["tokens"]
    assert patched["counted_bytes"] == stock["counted_bytes"]


def test_the_gate_matches_the_installed_source(envs):
    code = ("import sys, mlx_lm.models.cache, mlx_hotfix.patches.extract as e; "
            "print(e.check_shape(sys.modules['mlx_lm.models.cache']))")
    for version in VERSIONS:
        result = run_python(version, code, env={"MLX_HOTFIX_DISABLE": "extract"})
        assert result.stdout.strip() == "None", (version, result.stderr)
    applied = run_python("0.32.2", code)  # the shim already patched it
    assert applied.stdout.strip() == "already applied", applied.stderr
