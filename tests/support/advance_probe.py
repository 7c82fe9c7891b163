"""Measure ArraysCache.advance on the installed mlx-lm, stock or patched.

    python advance_probe.py MODEL_DIR STEPS

Prints one JSON object:
  tokens        greedy tokens of one prompt decoded STEPS times via BatchGenerator
  batch_tokens  greedy tokens of three prompts of different lengths, batched
  stale_nodes   the most graph nodes behind any linear layer's lengths or
                left_padding after the decode (stock: about one per step)
  values        lengths/left_padding/masks through advance, prepare,
                filter, extend, extract, merge, state and file round trips

Run it with and without the shim and compare: the tokens and values must be
identical, and stale_nodes must stay small when patched.
"""

from __future__ import annotations

import gc
import io
import json
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import cache as cache_module
from mlx_lm.models.cache import ArraysCache

from tests.support.tinymodel import decode_tokens


def raw_field(cache, name):
    """The field as stored, without folding a pending offset (patched) ."""
    state = vars(cache)
    if "_mlx_hotfix_" + name in state:
        return state["_mlx_hotfix_" + name]
    return state.get(name)


def graph_nodes(array) -> int:
    """Nodes in the unevaluated graph behind array (mx.export_to_dot recurses)."""
    result = []

    def count():
        out = io.StringIO()
        mx.export_to_dot(out, array)
        result.append(sum(1 for line in out.getvalue().splitlines() if "label" in line))

    threading.stack_size(512 * 1024 * 1024)
    worker = threading.Thread(target=count)
    worker.start()
    worker.join()
    return result[0]


def live_arrays_caches():
    return [o for o in gc.get_objects() if isinstance(o, ArraysCache)]


def decode_and_measure(model, prompt, steps):
    gen = BatchGenerator(model, max_tokens=steps)
    tokens = []
    try:
        (uid,) = gen.insert([prompt], [steps])
        while responses := gen.next_generated():
            for r in responses:
                if r.finish_reason != "stop":
                    tokens.append(int(r.token))
            if len(tokens) >= steps - 1:
                # Measure before the sequence finishes and its cache is dropped.
                break
        stale = 0
        for cache in live_arrays_caches():
            for name in ("lengths", "left_padding"):
                value = raw_field(cache, name)
                if value is not None:
                    stale = max(stale, graph_nodes(value))
    finally:
        gen.close()
    return tokens, stale


def show(value):
    if value is None:
        return None
    mx.eval(value)
    return value.tolist()


def fields(cache):
    return {"left_padding": show(cache.left_padding), "lengths": show(cache.lengths)}


def value_trace():
    trace = {}

    def filled(left_padding, batch):
        c = ArraysCache(2, left_padding=left_padding)
        c[0] = mx.arange(batch * 3, dtype=mx.float32).reshape(batch, 3)
        c[1] = mx.ones((batch, 2))
        return c

    c = filled([3, 0, 1], 3)
    c.advance(1)
    c.advance(2)
    trace["advance"] = fields(c)
    trace["mask_after_advance"] = show(c.make_mask(4))
    c.prepare(lengths=[5, 4, 6])
    c.advance(2)
    trace["prepare_advance"] = fields(c)
    trace["mask_prepared"] = show(c.make_mask(6))
    c.filter([0, 2])
    trace["filter"] = fields(c)
    c.advance(1)
    other = filled([2], 1)
    other.advance(1)
    c.extend(other)
    trace["extend"] = fields(c)
    c.advance(3)
    trace["extract"] = [show(x) for x in c.extract(1).cache]
    trace["after_extract"] = fields(c)

    # The copy shares c's arrays. Stock's in-place `-=` would then advance c
    # too when the copy advances (the patch does not alias); so c is not
    # read again after this.
    state = c.state
    copy = ArraysCache(2)
    copy.state = state
    trace["state_round_trip"] = fields(copy)
    copy.advance(2)
    trace["state_round_trip_advanced"] = fields(copy)

    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "cache.safetensors")
        cache_module.save_prompt_cache(path, [copy])
        (loaded,) = cache_module.load_prompt_cache(path)
        trace["file_round_trip"] = fields(loaded)

    parts = [filled(None, 1), filled(None, 1)]
    parts[0].advance(4)
    merged = ArraysCache.merge(parts)
    merged.advance(2)
    trace["merge"] = fields(merged)

    c.finalize()
    c.advance(5)
    trace["finalize"] = fields(c)
    return trace


def main():
    model_dir, steps = sys.argv[1], int(sys.argv[2])
    model, tokenizer = load(model_dir)
    prompt = tokenizer.encode("hello world, the loop goes on and on")
    tokens, stale = decode_and_measure(model, prompt, steps)
    prompts = [prompt, prompt[:3], prompt[:7]]
    batch_tokens = []
    for p in prompts:  # reference: alone
        batch_tokens.append(decode_tokens(model, p, 24))
    gen = BatchGenerator(model, max_tokens=24)
    together = {}
    try:
        uids = gen.insert(prompts, [24] * 3)
        while responses := gen.next_generated():
            for r in responses:
                if r.finish_reason != "stop":
                    together.setdefault(r.uid, []).append(int(r.token))
    finally:
        gen.close()
    print(json.dumps({
        "tokens": tokens,
        "alone_tokens": batch_tokens,
        "batch_tokens": [together.get(u, []) for u in uids],
        "stale_nodes": stale,
        "values": value_trace(),
    }))


if __name__ == "__main__":
    main()
