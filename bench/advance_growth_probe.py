"""Measure what ArraysCache.advance leaves behind during a long decode.

Runs inside one mlx-lm venv, with the shim on PYTHONPATH (patched advance) or
without it (stock); bench/memory_growth.py runs it once per variant:

    python bench/advance_growth_probe.py MODEL_DIR TOKENS [--sample-every K]
                                         [--micro N1,N2,...]

1. decode: greedy-decodes TOKENS tokens of one prompt through the real
   BatchGenerator (the server's engine), sampling every K tokens: tokens done,
   seconds since the first token, RSS (/proc/self/statm),
   mx.get_active_memory() and mx.get_cache_memory(). Just before the sequence would finish, it finds
   every live ArraysCache and times reading and mx.eval-ing their stale
   ``lengths``/``left_padding`` (stock: one lazy Subtract per step behind
   each; patched: one node), then samples RSS again.
2. micro: for each N, a fresh ArraysCache(left_padding=[0], lengths=[0])
   gets N ``advance(1)`` calls; reports the RSS those calls added and the
   time of one mx.eval of both fields afterwards.

Prints one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache

PAGE = os.sysconf("SC_PAGE_SIZE")
PROMPT = "hello world, the loop goes on and on"


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def active() -> int:
    try:
        return int(mx.get_active_memory())
    except Exception:  # noqa: BLE001 - older mlx
        return -1


def cached() -> int:
    """Freed MLX buffers MLX keeps for reuse (part of RSS, not of active())."""
    try:
        return int(mx.get_cache_memory())
    except Exception:  # noqa: BLE001 - older mlx
        return -1


def variant() -> dict:
    field = vars(ArraysCache).get("left_padding")
    return {
        "mlx_hotfix_loaded": "mlx_hotfix" in sys.modules,
        "advance": getattr(ArraysCache.advance, "__module__", "?"),
        "left_padding_is_descriptor": field is not None and hasattr(field, "__get__"),
    }


def stale_fields(caches):
    values = []
    for cache in caches:
        for name in ("lengths", "left_padding"):
            value = getattr(cache, name)
            if value is not None:
                values.append(value)
    return values


def decode(model, prompt, tokens, sample_every):
    gen = BatchGenerator(model, max_tokens=tokens + 8)
    samples = []
    out = {}
    try:
        (uid,) = gen.insert([prompt], [tokens + 8])
        done = 0
        t0 = None
        while done < tokens:
            responses = gen.next_generated()
            if not responses:
                break
            for r in responses:
                if r.uid == uid and r.finish_reason != "stop":
                    done += 1
                    if t0 is None:  # prefill is over: time the decode only
                        t0 = time.perf_counter()
                        samples.append({"tokens": done, "t": 0.0, "rss": rss(), "active": active(),
                                        "cache": cached()})
                    elif done % sample_every == 0 or done == tokens:
                        samples.append({"tokens": done, "t": time.perf_counter() - t0,
                                        "rss": rss(), "active": active(), "cache": cached()})
        out["decoded"] = done
        out["decode_s"] = time.perf_counter() - t0 if t0 is not None else None
        # The sequence is still in the batch: its caches hold the stale fields.
        gc.collect()
        caches = [o for o in gc.get_objects() if isinstance(o, ArraysCache)]
        out["arrays_caches"] = len(caches)
        rss_before = rss()
        t = time.perf_counter()
        values = stale_fields(caches)
        mx.eval(values)
        out["stale_eval_s"] = time.perf_counter() - t
        out["stale_fields"] = len(values)
        out["rss_before_eval"] = rss_before
        out["rss_after_eval"] = rss()
        del values, caches
    finally:
        gen.close()
    out["samples"] = samples
    return out


def micro(n):
    gc.collect()
    cache = ArraysCache(1, left_padding=[0])
    cache.lengths = mx.array([0])
    mx.eval(cache.left_padding, cache.lengths)
    before = rss()
    t = time.perf_counter()
    for _ in range(n):
        cache.advance(1)
    advance_s = time.perf_counter() - t
    grown = rss() - before
    t = time.perf_counter()
    values = [cache.left_padding, cache.lengths]
    mx.eval(values)
    eval_s = time.perf_counter() - t
    result = {"n": n, "advance_s": advance_s, "rss_growth": grown, "eval_s": eval_s,
              "values": [v.tolist() for v in values], "rss_after_eval": rss() - before}
    del cache, values
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("tokens", type=int)
    p.add_argument("--sample-every", type=int, default=250)
    p.add_argument("--micro", default="")
    a = p.parse_args()
    result = {"variant": variant(), "pid": os.getpid()}
    t = time.perf_counter()
    model, tokenizer = load(a.model_dir)
    result["load_s"] = time.perf_counter() - t
    result["rss_after_load"] = rss()
    prompt = tokenizer.encode(PROMPT)
    if a.tokens > 0:
        result["decode"] = decode(model, prompt, a.tokens, a.sample_every)
    result["micro"] = [micro(int(n)) for n in a.micro.split(",") if n.strip()]
    result["variant"] = variant()  # after load: the patch is applied on import
    print(json.dumps(result))


if __name__ == "__main__":
    main()
