"""advance: keep ArraysCache.advance from growing a lazy graph every step.

Reason: ml-explore/mlx-lm#1641, #1845 (also #1332, #1662). In the linear-
attention layers of hybrid models (qwen3_next, qwen3_5, mamba2, ...) each
decode step calls ``cache.advance(S)``, which stock writes as
``self.lengths -= N; self.left_padding -= N``. Nothing evaluates those
arrays during decode, so each step chains one more Subtract node behind
them: one live buffer per linear layer per token. On Metal that hits
``[metal::malloc] Resource limit (499000) exceeded`` after ~10k tokens and
kills the generation thread; on the CPU the graph and RSS just grow.

How: ``advance`` adds N to a plain Python int per field. The fields become
data descriptors on the class: reading ``lengths`` or ``left_padding``
subtracts the pending offset once (one graph node, however many steps) and
stores the result; assigning a field discards its pending offset, because
the new value replaces the one it applied to. Values read are identical to
stock's, with one deliberate difference: stock's in-place ``-=`` rebinds a
shared array object, so two caches holding the same ``left_padding`` object
(after ``b.state = a.state``) advance each other; patched caches do not.

Test: tests/test_patch_advance.py (greedy tokens identical on a tiny
qwen3_next; values identical to stock after filter/extend/merge/extract and
state save/restore; the stale graph stays one node deep).
"""

from .._wrap import _MARK, _wrap
from ._source import source_of

NAME = "advance"
TARGET = "mlx_lm.models.cache"
REASON = "ml-explore/mlx-lm#1641, #1845: ArraysCache.advance builds one lazy graph node per decode step"
VERSIONS = ("0.30.4", "0.33.0")  # ArraysCache.advance first appears in 0.30.4
FIXED_IN = None
TEST = "tests/test_patch_advance.py"
KIND = "fix"

FIELDS = ("lengths", "left_padding")


class DeferredOffsetField:
    """An mx.array attribute minus an offset that is kept as a Python int."""

    def __init__(self, name):
        self.name = name
        self.value_key = "_mlx_hotfix_" + name
        self.pending_key = "_mlx_hotfix_pending_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        state = obj.__dict__
        pending = state.get(self.pending_key, 0)
        if self.value_key not in state:
            # Set before the patch, or never set: stock semantics apply.
            return state.get(self.name)
        value = state[self.value_key]
        if pending:
            if value is not None:
                value = value - pending
                state[self.value_key] = value
            state[self.pending_key] = 0
        return value

    def __set__(self, obj, value):
        state = obj.__dict__
        state[self.value_key] = value
        state[self.pending_key] = 0

    def __delete__(self, obj):
        obj.__dict__.pop(self.value_key, None)
        obj.__dict__.pop(self.pending_key, None)

    def defer(self, obj, n):
        """Record advance(n) for this field without touching the graph."""
        state = obj.__dict__
        if self.value_key in state:
            if state[self.value_key] is not None:
                state[self.pending_key] = state.get(self.pending_key, 0) + n
        elif state.get(self.name) is not None:
            # A value from before the patch: adopt it, then defer.
            state[self.value_key] = state.pop(self.name)
            state[self.pending_key] = n


def _normalise(source):
    return "\n".join(line.strip() for line in source.strip().splitlines()[1:] if line.strip())


_STOCK_ADVANCE_BODY = _normalise(
    """def advance(self, N):
        if self.lengths is not None:
            self.lengths -= N
        if self.left_padding is not None:
            self.left_padding -= N
    """
)


def check_shape(cache):
    arrays_cache = getattr(cache, "ArraysCache", None)
    advance = getattr(arrays_cache, "advance", None)
    if arrays_cache is None:
        return "no ArraysCache in this release"
    if advance is None:
        return "no ArraysCache.advance in this release (it first appears in 0.30.4)"
    if getattr(advance, _MARK, False):
        return "already applied"
    for field in FIELDS:
        if field in vars(arrays_cache):
            return "ArraysCache.%s is already a class attribute" % field
    source = source_of(advance)
    if source is None:
        return "cannot read the source of ArraysCache.advance"
    if _normalise(source) != _STOCK_ADVANCE_BODY:
        return "ArraysCache.advance is no longer the lazy '-=' (fixed upstream?)"
    return None


def apply(cache):
    arrays_cache = cache.ArraysCache
    original = arrays_cache.advance
    fields = [DeferredOffsetField(name) for name in FIELDS]

    def advance(self, N):
        for field in fields:
            field.defer(self, N)

    for field in fields:
        setattr(arrays_cache, field.name, field)
    arrays_cache.advance = _wrap(original, advance)
