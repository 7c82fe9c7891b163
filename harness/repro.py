"""The two-request `extend` crash (upstream #1505/#1513), as measured in
shared/reference/field-notes.md: a long request without penalties, and 50 ms
later the same prompt with repetition_penalty, co-finish prefill in one
PromptProcessingBatch.extend."""

from __future__ import annotations

import random
import time

from .server import BackgroundRequest, StockServer

# Server flags that make the two prompts share a prefill batch.
PENALTY = 1.3
EXTEND_CRASH_ARGS = ("--prompt-concurrency", "2", "--prefill-step-size", "8")


def long_prompt(seed: int = 0) -> str:
    return f"{random.Random(seed).randint(10**5, 10**6)}" + " hello world " * 600


def warm_up_with_penalty(server: StockServer, timeout: float = 120) -> None:
    # A warm-up *without* a penalty leaves the batch in a state that hides the bug.
    server.warm_up(timeout=timeout, repetition_penalty=PENALTY)


def send_extend_crash_pair(server: StockServer, *, seed: int = 0, timeout: float = 120,
                           stream: bool = False) -> tuple:
    """Request A (no penalty), then B (penalty) 50 ms later. Returns both."""
    prompt = long_prompt(seed)
    a = BackgroundRequest(
        lambda: server.chat(prompt, max_tokens=20, timeout=timeout, stream=stream), name="A")
    time.sleep(0.05)
    b = BackgroundRequest(
        lambda: server.chat(prompt + " and then some more", max_tokens=20, timeout=timeout,
                            stream=stream, repetition_penalty=PENALTY), name="B")
    return a, b
