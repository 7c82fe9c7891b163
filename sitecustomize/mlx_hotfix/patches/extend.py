"""extend: empty lists, not None, as logits-processor placeholders when two
prompt batches merge.

Reason: ml-explore/mlx-lm#1505, fixed upstream by #1513 (0.32.0).
In 0.31.x ``PromptProcessingBatch.extend`` pads a batch that has no logits
processors with ``[None] * len(uids)``. When it merges with a batch that has
some (say a request with repetition_penalty), ``GenerationBatch._step`` runs
``for processor in self.logits_processors[e]`` over a None and the
generation thread dies with ``TypeError: 'NoneType' object is not iterable``.
Two plain HTTP requests trigger it.

How: call the stock extend, then replace each None placeholder in
``logits_processors`` with an empty list (what a request without
processors has anyway). Samplers keep their None placeholders: stock reads
those with ``self.samplers[e] or self.fallback_sampler``.

Test: tests/test_patch_extend.py (the two-request crash on the stock 0.31.3
server, off and on).
"""

from .._wrap import _MARK, _wrap
from ._source import flat, source_of

NAME = "extend"
TARGET = "mlx_lm.generate"
REASON = "ml-explore/mlx-lm#1505, #1513: None logits-processor placeholders in PromptProcessingBatch.extend"
VERSIONS = ("0.31.2", "0.32.0")  # PromptProcessingBatch first appears in 0.31.2
FIXED_IN = "0.32.0"
TEST = "tests/test_patch_extend.py"
KIND = "fix"

# The statements the bug lives in, verbatim as stock 0.31.2 and 0.31.3 write
# them (whitespace aside): the patch only fits code that still has both.
_BUGGY_STATEMENTS = (
    "self.logits_processors = [None] * len(self.uids)",
    "else [None] * len(batch.uids)",
    "self.logits_processors.extend(logits_processors)",
)


def check_shape(generate):
    batch = getattr(generate, "PromptProcessingBatch", None)
    if batch is None:
        return "no PromptProcessingBatch in this release (the None placeholders arrived with it in 0.31.2)"
    extend = getattr(batch, "extend", None)
    if extend is None:
        return "mlx_lm.generate.PromptProcessingBatch.extend is missing"
    if getattr(extend, _MARK, False):
        return "already applied"
    source = source_of(extend)
    if source is None:
        return "cannot read the source of PromptProcessingBatch.extend"
    if not all(statement in flat(source) for statement in _BUGGY_STATEMENTS):
        return "PromptProcessingBatch.extend no longer pads logits processors with None"
    return None


def _without_none(processors):
    return [[] if p is None else p for p in processors]


def apply(generate):
    batch = generate.PromptProcessingBatch
    original = batch.extend

    def extend(self, other):
        original(self, other)
        self.logits_processors = _without_none(self.logits_processors)

    batch.extend = _wrap(original, extend)
