"""prompt_cache_bytes: ``--prompt-cache-bytes`` bounds the prompt cache at every moment.

Reason: ml-explore/mlx-lm#1390 (open; PRs #1267, #1392, #1409 not merged).
``run()`` builds the cache as ``LRUPromptCache(model_provider.cli_args.
prompt_cache_size)``: the entry count only, so its ``max_bytes`` stays
``1 << 63`` and ``insert_cache`` never evicts by bytes. The flag acts in one
place alone: when a request joins the running batch, ``trim_to(n_bytes=
limit - active batch bytes)``. So, measured on stock 0.32.2 and 0.31.3 with
``--prompt-cache-bytes 300000`` (tests/test_patch_prompt_cache_bytes.py):

- every cache inserted after that trim goes in untrimmed: a request's cache
  when it finishes, and segment caches during its prefill. Eight concurrent
  requests leave eight entries (~0.9 MB, three times the limit) the moment
  the last one finishes, and the cache stays over the limit, idle, for as
  long as no new request joins a batch: minutes, or all night;
- requests served one at a time (a ``seed``, ``--kv-bits``, an image, a
  draft model: ``_serve_single``) never trim at all: the cache grows by one
  entry per distinct prompt up to ``--prompt-cache-size`` (10) entries,
  whatever their bytes, until a batched request happens to come.

How: ``ResponseGenerator.__init__`` (which ``run()`` calls with the cache it
built) gives the cache ``max_bytes = --prompt-cache-bytes`` before the
generation thread starts, so the stock ``insert_cache`` evicts, least
recently used first, on every insert, on every serving path. Stock's trim at
batch join stays (it also leaves room for the active batch). A cache built
some other way (a caller of ``run()`` with its own bound) keeps the smaller
of the two bounds. Only which entries stay cached changes: outputs are the
same, a later request just finds fewer prefixes cached. In an
``mx.distributed`` group every rank evicts by its own bytes, as stock's
batch-join trim already does.

Gate: ``run()`` still builds the cache with the entry count only (verbatim),
``LRUPromptCache.insert_cache`` still evicts while ``_n_bytes > max_bytes``,
and ``ResponseGenerator.__init__`` takes ``(model_provider, prompt_cache)``.
Off switch: MLX_HOTFIX_DISABLE=prompt_cache_bytes.
Test: tests/test_patch_prompt_cache_bytes.py.
"""

from .._wrap import _wrap, wrapped_by
from ._source import flat, source_of

NAME = "prompt_cache_bytes"
TARGET = "mlx_lm.server"
REASON = "ml-explore/mlx-lm#1390: --prompt-cache-bytes is not passed to LRUPromptCache"
VERSIONS = ("0.31.2", "0.33.0")  # read: 0.31.2 to 0.32.2 (0.31.0 evicts in its own way)
FIXED_IN = None
TEST = "tests/test_patch_prompt_cache_bytes.py"
KIND = "fix"

_BUGGY_CONSTRUCTION = "prompt_cache = LRUPromptCache(model_provider.cli_args.prompt_cache_size)"
_EVICTION = "while self._n_bytes > self.max_bytes:"


def check_shape(server):
    run, cache_class = getattr(server, "run", None), getattr(server, "LRUPromptCache", None)
    generator = getattr(server, "ResponseGenerator", None)
    if run is None or cache_class is None or generator is None:
        return "mlx_lm.server has no run, LRUPromptCache or ResponseGenerator"
    if wrapped_by(generator.__init__, NAME):
        return "already applied"
    source = source_of(run)
    if source is None:
        return "cannot read the source of mlx_lm.server.run"
    if _BUGGY_CONSTRUCTION not in flat(source):
        return "run() no longer builds LRUPromptCache with the entry count only (fixed upstream?)"
    insert = source_of(getattr(cache_class, "insert_cache", None))
    if insert is None or _EVICTION not in flat(insert):
        return "LRUPromptCache.insert_cache does not evict by max_bytes in this release"
    import inspect

    try:
        parameters = list(inspect.signature(generator.__init__).parameters)
    except (TypeError, ValueError):
        parameters = []
    if parameters[1:3] != ["model_provider", "prompt_cache"]:
        return "ResponseGenerator.__init__ does not take (model_provider, prompt_cache)"
    return None


def bound(prompt_cache, model_provider):
    """Give prompt_cache the --prompt-cache-bytes limit (the smaller bound wins)."""
    limit = getattr(getattr(model_provider, "cli_args", None), "prompt_cache_bytes", None)
    current = getattr(prompt_cache, "max_bytes", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or not isinstance(current, int):
        return
    if limit < current:
        prompt_cache.max_bytes = limit
        prompt_cache.trim_to(n_bytes=limit)  # empty at start; a cache given full


def apply(server):
    generator = server.ResponseGenerator
    original = generator.__init__

    def __init__(self, model_provider, prompt_cache, *args, **kwargs):
        bound(prompt_cache, model_provider)  # before the generation thread starts
        original(self, model_provider, prompt_cache, *args, **kwargs)

    generator.__init__ = _wrap(original, __init__, NAME)
