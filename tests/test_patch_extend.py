"""extend: the two-request crash (upstream #1505/#1513) on the real stock
0.31.3 server, reproduced on stock, then with the patch off and on."""

from __future__ import annotations

import pytest
import requests

from harness.repro import (
    EXTEND_CRASH_ARGS,
    long_prompt,
    send_extend_crash_pair,
    warm_up_with_penalty,
)
from harness.server import run_python

pytestmark = pytest.mark.server


def _content(request) -> str:
    return request.json()["choices"][0]["message"]["content"]


def test_stock_031_dies_on_the_two_requests_and_becomes_a_zombie(servers, tiny_llama):
    server = servers("0.31.3", tiny_llama, shim=False, args=EXTEND_CRASH_ARGS)
    warm_up_with_penalty(server)
    a, b = send_extend_crash_pair(server, timeout=20)
    assert a.join(60) and b.join(60)
    assert a.status == 200
    assert isinstance(b.error, requests.Timeout), b  # B hangs forever on stock
    assert "TypeError: 'NoneType' object is not iterable" in server.log()
    assert "for processor in self.logits_processors[e]" in server.log()
    assert server.alive() and server.health() == 200  # the zombie calls itself healthy


def test_with_the_patch_off_the_shim_turns_the_crash_into_exit_70(servers, tiny_llama):
    server = servers("0.31.3", tiny_llama, args=EXTEND_CRASH_ARGS,
                     env={"MLX_HOTFIX_DISABLE": "extend"})
    warm_up_with_penalty(server)
    a, b = send_extend_crash_pair(server, timeout=60)
    assert server.wait_exit(60) == 70, server.log()
    assert a.join(70) and b.join(70)
    # a finishes before the death when it gets there first (a quiet machine);
    # under load both are in the batch that dies: answered 503 too, never hung.
    assert a.status in (200, 503), a
    assert b.status == 503 and "TypeError" in b.json()["error"]["message"], b
    assert ("mlx-hotfix: generation thread died: extend: TypeError: 'NoneType' object is "
            "not iterable; exiting 70") in server.hotfix_lines()


def test_with_the_patch_on_both_requests_and_later_ones_complete_correctly(servers, tiny_llama):
    # Reference: each request served alone by stock 0.31.3 (no merge, no crash).
    reference = servers("0.31.3", tiny_llama, shim=False, args=EXTEND_CRASH_ARGS)
    reference.warm_up()
    prompt = long_prompt(0)
    expected_a = reference.chat(prompt, max_tokens=20).json()["choices"][0]["message"]["content"]
    expected_b = reference.chat(prompt + " and then some more", max_tokens=20,
                                repetition_penalty=1.3).json()["choices"][0]["message"]["content"]
    reference.stop()

    server = servers("0.31.3", tiny_llama, args=EXTEND_CRASH_ARGS)
    warm_up_with_penalty(server)
    assert "extend applied" in server.hotfix_lines()[0]
    a, b = send_extend_crash_pair(server, timeout=120)
    assert a.join(130) and b.join(130)
    assert (a.status, b.status) == (200, 200), (a, b, server.log()[-3000:])
    for request in (a, b):
        assert request.json()["usage"]["completion_tokens"] == 20
    assert (_content(a), _content(b)) == (expected_a, expected_b)

    # The batch machinery is still sound: another merged pair, then singles.
    a2, b2 = send_extend_crash_pair(server, seed=1, timeout=120)
    assert a2.join(130) and b2.join(130) and (a2.status, b2.status) == (200, 200)
    for _ in range(3):
        assert server.chat("later", max_tokens=5, repetition_penalty=1.1).status_code == 200
    assert server.alive() and "Traceback" not in server.log()


def test_stock_032_has_the_upstream_fix_and_the_patch_stays_out(servers, tiny_llama):
    server = servers("0.32.2", tiny_llama, args=EXTEND_CRASH_ARGS)
    warm_up_with_penalty(server)
    assert ("extend skipped: PromptProcessingBatch.extend no longer pads logits processors with None "
            "(fixed upstream in 0.32.0)") in server.hotfix_lines()[0]
    a, b = send_extend_crash_pair(server, timeout=120)
    assert a.join(130) and b.join(130)
    assert (a.status, b.status) == (200, 200)


def test_the_gate_reads_the_buggy_line_from_the_installed_source(envs):
    # (mlx_lm.generate the attribute is a function: read the module from sys.modules)
    code = ("import sys, mlx_lm.generate, mlx_hotfix.patches.extend as e; "
            "print(e.check_shape(sys.modules['mlx_lm.generate']))")
    assert run_python("0.31.3", code, env={"MLX_HOTFIX_DISABLE": "extend"}).stdout.strip() == "None"
    assert run_python("0.32.2", code).stdout.strip() == (
        "PromptProcessingBatch.extend no longer pads logits processors with None")
