"""extract: one sequence's linear-attention state copied out of the batch, not a view of it.

Reason: ml-explore/mlx-lm#1701 (open). ``ArraysCache.extract(idx)`` (the
conv and recurrent state of hybrid models: qwen3_next, qwen3_5, mamba2, ...)
returns ``[c[idx : idx + 1] for c in self.cache]``: a slice of the batch's
arrays, which keeps the whole batch's buffer alive. The server extracts a
finished request's cache and inserts it into the prompt cache, so every
entry holds its whole batch's state while its ``nbytes`` counts one row:
the prompt cache's byte accounting (and ``--prompt-cache-bytes``) is wrong
by up to the batch size. Measured on stock 0.32.2 and 0.31.3 (mlx 0.32.4,
CPU; tests/test_patch_extract.py): one sequence extracted from a batch of 8
still holds the batch's full state after the batch is dropped.

How: the same slice, then ``mx.contiguous`` (a copy, as stock's own
``BatchKVCache.extract`` does for keys and values) and ``mx.eval`` of the
copies, so no lazy node keeps the batch's buffer either. Values are
identical (a copy); ``lengths`` and ``left_padding`` are untouched, as in
stock.

Gate: ``ArraysCache.extract`` is still the three stock lines (verbatim,
whitespace aside). Off switch: MLX_HOTFIX_DISABLE=extract.
Test: tests/test_patch_extract.py.
"""

from .._wrap import _MARK, _wrap
from ._source import source_of

NAME = "extract"
TARGET = "mlx_lm.models.cache"
REASON = "ml-explore/mlx-lm#1701: ArraysCache.extract keeps the whole batch's arrays alive"
VERSIONS = ("0.30.7", "0.33.0")  # read: 0.30.7 to 0.32.2 have the slice (0.29.1 has no extract)
FIXED_IN = None
TEST = "tests/test_patch_extract.py"
KIND = "fix"

_STOCK_BODY = (
    "cache = ArraysCache(len(self.cache))",
    "cache.cache = [c[idx : idx + 1] for c in self.cache]",
    "return cache",
)


def _body(source):
    lines = [line.strip() for line in source.strip().splitlines()[1:]]
    return tuple(" ".join(line.split()) for line in lines if line)


def check_shape(cache):
    arrays_cache = getattr(cache, "ArraysCache", None)
    if arrays_cache is None:
        return "no ArraysCache in this release"
    extract = vars(arrays_cache).get("extract")
    if extract is None:
        return "no ArraysCache.extract in this release"
    if getattr(extract, _MARK, False):
        return "already applied"
    source = source_of(extract)
    if source is None:
        return "cannot read the source of ArraysCache.extract"
    if _body(source) != _STOCK_BODY:
        return "ArraysCache.extract no longer returns a slice of the batch (fixed upstream?)"
    return None


def apply(cache):
    import mlx.core as mx  # mlx_lm is loaded by now

    arrays_cache = cache.ArraysCache
    original = arrays_cache.extract

    def extract(self, idx):
        extracted = arrays_cache(len(self.cache))
        rows = [mx.contiguous(c[idx : idx + 1]) for c in self.cache]
        mx.eval(rows)  # a pending copy would still hold the batch's buffer
        extracted.cache = rows
        return extracted

    arrays_cache.extract = _wrap(original, extract, NAME)
