"""Hostile request bodies for mlx_lm.server, deterministic from a seed.

``bodies(seed, count)`` yields ``(path, data)`` pairs: a valid chat or text
completion whose fields are then replaced, one to four at a time, by values
of the wrong type, nested, huge, negative, NaN or infinite, empty or huge
strings and lists, unknown logit_bias keys, malformed messages and images;
and a few bodies that are not objects at all. The same seed gives the same
bodies (``random.Random(seed)``). Used by tests/test_patch_validate.py.

Requests that stock would serve for a long time are avoided (a fuzz must be
quick): max_tokens stays small unless the value is invalid anyway.
"""

from __future__ import annotations

import json
import random
from typing import Iterator, Tuple

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"

NAN, INF = float("nan"), float("inf")
DEEP_LIST: list = []
for _ in range(60):
    DEEP_LIST = [DEEP_LIST]

# Values of every shape, for any field.
ANY = [
    None, True, False, 0, 1, -1, 2, 7, 11, 12, 299, 300, 2 ** 31 - 1, 2 ** 31, 2 ** 63,
    2 ** 64, 2 ** 70, -2 ** 70, 10 ** 30, 0.0, -0.0, 0.5, -0.5, 0.9, 1.5, 1e308, -1e308,
    1e-308, NAN, INF, -INF, "", " ", "x", "0", "1", "true", "null", "NaN", "\u0000",
    "\u202e\ud7ff", "x" * 20000, [], [[]], [["x"]], ["a", 5], [None], ["a", "b"], [1, 2, 3],
    list(range(500)), DEEP_LIST, {}, {"a": 1}, {"5": 1}, {"type": 5}, {"include_usage": "yes"},
    {"include_usage": True}, {"url": 5},
]

FIELDS = {
    # field: extra values that fit it nearly (valid, or wrong in one detail)
    "stop": ["", [""], ["\n"], ["a", ["b"]], "stop", ["x"] * 200, {"a": [1]}],
    "max_tokens": [0, 1, 2, 3, -5],
    "max_completion_tokens": [0, 1, 3, -1],
    "temperature": [0, 0.7, 1, 2.0, -0.1, 10 ** 400],
    "top_p": [0, 0.1, 1, 1.01, -0.01],
    "top_k": [0, 1, 5, 299, 300, 301, 10 ** 6, -3],
    "min_p": [0, 0.05, 1, 1.5],
    "repetition_penalty": [0, 1.1, 1e6, -1],
    "repetition_context_size": [0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 40, -1],
    "presence_penalty": [0, 0.5, -2, 1e300],
    "presence_context_size": [0, 2 ** 31, 2 ** 40],
    "frequency_penalty": [0, 0.5, -2],
    "frequency_context_size": [0, 2 ** 31, 2 ** 40],
    "xtc_probability": [0.0, 0.5, 1.0, 0, 1],
    "xtc_threshold": [0.0, 0.1, 0.5, 0.6, 0.9, 1.0],
    "logit_bias": [{"5": 10}, {"299": -100}, {"300": 1}, {"-1": 1}, {"99999999999": 1},
                   {str(2 ** 31): 1}, {"5": "1.5"}, {"5": NAN}, {"5": [1]}, {"x": 1},
                   {"5": 10 ** 400}, {" 5 ": 1}, {"5_0": 1},
                   {str(i): 1 for i in range(300)}],
    "logprobs": [True, False, 1],
    "top_logprobs": [-1, 0, 5, 11, 12, -2],
    "seed": [0, 7, -1, 2 ** 64 - 1, 2 ** 64],
    "stream": [True, False, 1, "true"],
    "stream_options": [{"include_usage": True}, {"include_usage": False}, {}, [],
                       {"include_usage": None}],
    "model": ["default_model", "", "/no/such/model", ["x"], {"a": 1}],
    "draft_model": [None, "default_model", ["x"], {"a": 1}],
    "adapters": [None, "", "/no/such/adapter"],
    "num_draft_tokens": [0, 3, -1, 2 ** 40],
    "chat_template_kwargs": [{}, {"enable_thinking": False}, {"tools": 5}, {"tokenize": False},
                             [1]],
    "n": [1, 2, 0, -1],
    "response_format": [{"type": "text"}, {"type": "json_object"}, {"type": 5}, "json"],
    "tool_choice": ["auto", "none", {"type": "function"}, 5],
    "tools": [[], [{"type": "function", "function": {"name": "f", "parameters": {}}}],
              ["x"], [{}], {"a": 1}],
    "role_mapping": [{}, {"user": "U: "}, {"user": 5}, ["x"]],
    "user": ["someone", 5],
    "unknown_field": [1, "x"],
    "messages": [
        [], [{}], [{"role": 5}], [{"role": "user"}], [{"role": "user", "content": None}],
        [{"role": "user", "content": 5}], [{"role": "user", "content": {"a": 1}}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        [{"role": "user", "content": [{"text": "x"}]}],
        [{"role": "user", "content": ["x"]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}],
        [{"role": "user", "content": [{"type": "image_url",
                                       "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "file:///etc/passwd"}]}],
        [{"role": "user", "content": [{"type": "input_image", "image": "data:,"}]}],
        [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}],
        [{"role": "user", "content": ""}], [{"role": "system", "content": "s"}],
        [{"role": "assistant", "content": "a"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        [{"role": "tool", "content": "t"}], [{"role": "", "content": "x"}],
        [{"role": "user", "content": "x", "tool_calls": 5}],
        [{"role": "assistant", "content": None, "tool_calls": [{"function": {
            "name": "f", "arguments": "{not json"}}]}],
        [{"role": "assistant", "content": None, "tool_calls": ["x"]}],
        [{"role": "user", "content": "x " * 500}],
        "hi", {"role": "user", "content": "x"}, [["user", "x"]],
    ],
    "prompt": ["", " ", "\n", "x", "hello", ["a"], [1, 2], None, 5, "x " * 500, "\u0000"],
}

_LONG_RUNNING_TOKENS = 16  # a valid max_tokens above this is replaced (speed)
_LONG_PROMPT = 2000  # and a longer prompt (its prefill takes long on a busy CPU)


def _base(rng: random.Random, path: str) -> dict:
    body = {"model": "default_model", "max_tokens": rng.choice([1, 2, 3]),
            "temperature": rng.choice([0.0, 0.0, 0.8])}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "tell me", "x"])}]
    else:
        body["prompt"] = rng.choice(["hello", "once upon", "a"])
    return body


def _value(rng: random.Random, field: str):
    while True:
        # Near-valid values exercise the generation thread, any value the parser.
        draw = rng.random()
        pool = FIELDS[field] if draw < 0.4 else FIELDS[field] + ANY if draw < 0.7 else ANY
        value = rng.choice(pool)
        if field in ("max_tokens", "max_completion_tokens") and isinstance(value, int) \
                and not isinstance(value, bool) and value > _LONG_RUNNING_TOKENS:
            continue
        if field == "prompt" and isinstance(value, str) and len(value) > _LONG_PROMPT:
            continue
        return value


def body_for(rng: random.Random) -> Tuple[str, object]:
    """One request: (path, body), the body possibly not an object."""
    if rng.random() < 0.03:
        return rng.choice([CHAT, TEXT]), rng.choice([[], "x", 5, None, [{"a": 1}], DEEP_LIST])
    path = CHAT if rng.random() < 0.7 else TEXT
    body = _base(rng, path)
    for field in rng.sample(sorted(FIELDS), rng.randint(1, 4)):
        if rng.random() < 0.05:
            body.pop(field, None)
        else:
            body[field] = _value(rng, field)
    return path, body


def bodies(seed: int, count: int) -> Iterator[Tuple[str, bytes, object]]:
    """(path, encoded body, body) for count requests, the same for a seed."""
    rng = random.Random(seed)
    for _ in range(count):
        path, body = body_for(rng)
        yield path, json.dumps(body, allow_nan=True).encode(), body
