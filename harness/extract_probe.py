"""Measure ArraysCache.extract on the installed mlx-lm, stock or patched.

    python -m harness.extract_probe MODEL_DIR   (from the repository root)

Decodes a batch of 8 prompts on a tiny hybrid model through the real
``BatchGenerator``, extracts one sequence's cache (as the server does for
the prompt cache), drops the generator and its batch, and prints one JSON
object:
  held_bytes      MLX active memory the extracted cache still holds
  counted_bytes   what its ``nbytes`` says (what LRUPromptCache counts)
  linear_counted  the same for its ArraysCache layers only
  linear_batch    the bytes of those layers' arrays for the whole batch
  values          every extracted array, as lists
  tokens          greedy tokens decoded on from the extracted cache

Run it with and without the shim and compare: values and tokens must be
identical, and held_bytes must come down to counted_bytes when patched.
"""

from __future__ import annotations

import gc
import json
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache

BATCH = 8
PICK = 3  # the sequence to extract


def settle():
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def decode_from(model, cache, token, n):
    """Greedy tokens decoded on from cache, one token at a time."""
    out = []
    for _ in range(n):
        logits = model(mx.array([[token]]), cache=cache)
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
    return out


def main():
    model, tokenizer = load(sys.argv[1])
    prompts = [tokenizer.encode(f"sequence {i}: the loop goes on and on " * (i + 1))
               for i in range(BATCH)]
    gen = BatchGenerator(model, max_tokens=64)
    uids = gen.insert(prompts, [64] * BATCH)
    last = {}
    while len(last) < BATCH:  # until every sequence decodes in the batch
        for r in gen.next_generated():
            last[r.uid] = int(r.token)
    (caches, _tokens), = gen.extract_cache([uids[PICK]]).values()
    linear = [c for c in caches if isinstance(c, ArraysCache)]
    linear_batch = sum(array_bytes(c) for c in gen._generation_batch.prompt_cache
                       if isinstance(c, ArraysCache))
    mx.eval([a for c in caches for a in arrays(c)])
    gen.close()
    del gen
    held = settle()
    result = {
        "held_bytes": held,
        "counted_bytes": sum(c.nbytes for c in caches),
        "linear_counted": sum(array_bytes(c) for c in linear),
        "linear_batch": linear_batch,
        "values": [[None if a is None else a.tolist() for a in c.cache] for c in linear],
        "tokens": decode_from(model, caches, last[uids[PICK]], 8),
    }
    del caches, linear
    result["held_bytes"] -= settle()  # what is left is the model's own
    print(json.dumps(result))


def arrays(cache):
    if isinstance(cache, ArraysCache):
        return [a for a in cache.cache if a is not None]
    return [a for a in (getattr(cache, "keys", None), getattr(cache, "values", None))
            if a is not None]


def array_bytes(cache):
    return sum(a.nbytes for a in arrays(cache))


if __name__ == "__main__":
    main()
