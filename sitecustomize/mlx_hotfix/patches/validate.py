"""validate: one request cannot take the server down.

Reason: stock mlx_lm.server hands request fields to its one generation thread
unchecked, and a bad one kills that thread for every client (issue 18 of
this project; upstream ml-explore/mlx-lm#1505 is what a death costs). One
unauthenticated ``"stop": [["x"]]`` (``tuple(stop_words)`` in
``_make_state_machine``: unhashable) or ``"stop": ["a", 5]``
(``tokenizer.encode(5)``) does it on 0.31.3 and 0.32.2, outside any
``try``; so do a ``top_k`` at or above the vocabulary size, an
``xtc_threshold`` above 0.5, a NaN ``min_p``, a penalty context size of 2**31
or more ("Slice indices must be 32-bit integers"), an empty text prompt, and,
on 0.31.x, any XTC sampling at all. A ``logit_bias`` key of 2**31 or more
crashes the process (SIGSEGV); one outside the vocabulary writes outside the
logits.

How: ``APIHandler.validate_model_parameters`` (stock calls it in ``do_POST``
once the body is parsed and the fields are read, before the stop words, the
request factory and ``handle_completion``) first runs the checks below, on
the HTTP handler's thread. A bad field is answered at once, and nothing
reaches the generation thread:

    400 {"error": {"message": "...", "type": "invalid_request_error",
                   "param": "<field>", "code": 400}}

``param`` names the top-level field; the message names the exact element
(``stop[1] must be a string, not int``). A field the request leaves out
takes stock's default (the server's ``--temp``, ``--top-k`` ... for the
sampling ones) and is checked the same way. Nothing stock serves correctly
is refused: each rule is stock's own (``_validate``) plus what it misses,
and a rule that depends on the sampler applies only when stock builds that
sampler. Numbers must be finite (JSON has no NaN or Infinity; Python's
parser reads them) and an integer given for a number must fit in 64 bits
(mlx: std::bad_cast, death). true and false are not numbers (stock lets
them pass as 1 and 0, and ``top_logprobs: true`` then kills the thread in
a slice).

field                  must be (what stock does with a bad one)
---------------------  ---------------------------------------------------------
model                  a string (the model to load)
adapters               null or a string
draft_model            null or a string (unhashable: that request fails)
num_draft_tokens       an integer >= 0
stream                 true or false
stream_options         when streaming: null, or an object with a boolean
                       include_usage (read after the last token: KeyError, and
                       the stream ends without [DONE])
max_completion_tokens  an integer >= 1 (the first given of the two wins, as
max_tokens             stock reads them; 0.32 refuses 0 itself, 0.31 answers one
                       token, or breaks off on its unbatched path)
temperature            a finite number >= 0 (a huge integer: OverflowError in
                       the sampler, death)
top_p, min_p           a finite number in [0, 1] (NaN min_p: death)
top_k                  an integer >= 0; when sampling (temperature > 0), 0 or
                       below the model's vocabulary size (apply_top_k raises:
                       death)
xtc_probability        a finite float in [0, 1]
xtc_threshold          a finite float in [0, 1]; when XTC runs (temperature > 0
                       and xtc_probability > 0) at most 0.5 (death); on a
                       release whose XTC always raises (0.31.x:
                       ``xtc_special_tokens`` nests the newline's ids), XTC is
                       refused
repetition_penalty     a finite number >= 0
presence_penalty,      finite numbers (an integer of 2**63 or more: death)
frequency_penalty
*_context_size         (repetition, presence, frequency) an integer >= 0, and
                       below 2**31 when its penalty is not 0 (death)
logit_bias             null, or an object whose keys are token ids in the
                       model's vocabulary (read as stock reads them, int(key))
                       and whose values are finite numbers (float(value))
logprobs               true or false
top_logprobs           -1, or an integer from 0 to 11 (true: death)
seed                   null, or an integer from 0 to 2**64 - 1 (mx.random.seed
                       raises: the answer breaks off)
stop                   null, a string, or a list of strings (death)
chat_template_kwargs   null or an object
messages (chat)        a non-empty list of objects with a string role; content
                       null, a string, or a list of parts (objects with a
                       string type; a text part has a string text; an image
                       part's image_url or image is a string or an object with
                       a string url); tool_calls null or a list of objects
role_mapping           null or an object
tools                  null or a list of objects
prompt (text)          a string that the model's tokenizer does not encode to
                       no tokens ("Sequence N has an empty prompt": death)
n                      null or an integer >= 1 (stock ignores it: one choice)
response_format        null, or an object with a string type (stock ignores it)
tool_choice            null, a string or an object (stock ignores it)

The vocabulary size is the loaded model's when the request resolves to it
(worked out with stock's own ``ModelProvider.load`` key logic); for another
model, or before the first load, it comes from that model's config.json
(a local folder or the Hugging Face cache). When it cannot be known, a
``top_k`` that would sample or a non-empty ``logit_bias`` is refused with
that reason. The prompt check encodes prompts of up to 64 characters with
the loaded tokenizer (a longer one is never empty); before the first load
only ``""`` is refused.

Test: tests/test_patch_validate.py (the two stop deaths reproduced on the
stock 0.31.3 and 0.32.2 servers with the exit part on and off; every
refused field; valid requests answered exactly as stock; a seeded fuzz of
the request body against one server per release).
"""

import json
import math

from .. import log
from .._wrap import _wrap, wrapped_by
from ._http import send_json
from ._source import flat, source_of

NAME = "validate"
TARGET = "mlx_lm.server"
REASON = "one request's bad field kills the generation thread for every client (issue 18)"
VERSIONS = ("0.31.0", "0.33.0")
FIXED_IN = None
TEST = "tests/test_patch_validate.py"
KIND = "fail-safe"

_SLICE_LIMIT = 2 ** 31  # mlx slices take 32-bit indices
_SEED_LIMIT = 2 ** 64  # mx.random.seed takes a uint64
_INT64 = 2 ** 63  # mlx takes a Python integer as a 64-bit one
_SHORT_PROMPT = 64  # prompts this short are encoded to see that they are not empty
_xtc_always_fails = False  # set by apply() from the release's _make_sampler


class Invalid(Exception):
    """A field the generation thread must not get: (param, message)."""

    def __init__(self, param, message):
        super().__init__(message)
        self.param = param
        self.message = message


class _Refused(BaseException):
    """Unwinds stock's do_POST once the 400 is sent (a BaseException: stock's
    ``except Exception`` must not answer a second time)."""


# -- value checks ----------------------------------------------------------------


def _kind(value):
    return "null" if value is None else type(value).__name__


def _is_int(value):
    # Not a bool: stock's isinstance(value, int) lets true through, and mlx then
    # slices with it (top_logprobs: true kills the generation thread).
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value):
    """A number mlx can compute with: finite, and an integer within 64 bits
    (a larger one is std::bad_cast in mlx arithmetic: death)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):
        return -_INT64 <= value < _INT64
    return math.isfinite(value)


def _int(value, name, low=None, high=None, param=None):
    param = param or name
    if not _is_int(value):
        raise Invalid(param, "%s must be an integer, not %s" % (name, _kind(value)))
    if low is not None and value < low:
        raise Invalid(param, "%s must be at least %d, not %d" % (name, low, value))
    if high is not None and value > high:
        raise Invalid(param, "%s must be at most %d, not %d" % (name, high, value))


def _number(value, name, low=None, high=None, *, floats_only=False, param=None):
    param = param or name
    kinds = (float,) if floats_only else (int, float)
    if not isinstance(value, kinds) or isinstance(value, bool):
        what = "a float" if floats_only else "a number"
        raise Invalid(param, "%s must be %s, not %s" % (name, what, _kind(value)))
    if not _finite(value):
        if isinstance(value, int):
            raise Invalid(param, "%s must be within 64 bits (below 2**63), not %d"
                          % (name, value))
        raise Invalid(param, "%s must be a finite number, not %r" % (name, value))
    if low is not None and value < low:
        raise Invalid(param, "%s must be at least %g, not %g" % (name, low, value))
    if high is not None and value > high:
        raise Invalid(param, "%s must be at most %g, not %g" % (name, high, value))


def _bool(value, name):
    if not isinstance(value, bool):
        raise Invalid(name, "%s must be true or false, not %s" % (name, _kind(value)))


def _string_or_null(value, name):
    if value is not None and not isinstance(value, str):
        raise Invalid(name, "%s must be a string, not %s" % (name, _kind(value)))


def _object_or_null(value, name, param=None):
    if value is not None and not isinstance(value, dict):
        raise Invalid(param or name, "%s must be an object, not %s" % (name, _kind(value)))


def _list_of_objects_or_null(value, name, param=None):
    if value is None:
        return
    if not isinstance(value, list):
        raise Invalid(param or name, "%s must be a list, not %s" % (name, _kind(value)))
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise Invalid(param or name, "%s[%d] must be an object, not %s"
                          % (name, i, _kind(item)))


# -- the fields ------------------------------------------------------------------


def _check_stop(body):
    stop = body.get("stop")
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list):
        raise Invalid("stop", "stop must be a string or a list of strings, not %s" % _kind(stop))
    for i, word in enumerate(stop):
        if not isinstance(word, str):
            raise Invalid("stop", "stop[%d] must be a string, not %s" % (i, _kind(word)))


def _check_content(content, where):
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise Invalid("messages", "%s must be a string, a list of parts or null, not %s"
                      % (where, _kind(content)))
    for i, part in enumerate(content):
        at = "%s[%d]" % (where, i)
        if not isinstance(part, dict):
            raise Invalid("messages", "%s must be an object, not %s" % (at, _kind(part)))
        kind = part.get("type")
        if not isinstance(kind, str):
            raise Invalid("messages", "%s.type must be a string, not %s" % (at, _kind(kind)))
        if kind == "text" and not isinstance(part.get("text"), str):
            raise Invalid("messages", "%s.text must be a string, not %s"
                          % (at, _kind(part.get("text"))))
        if kind in ("image_url", "input_image", "image"):
            key = "image_url" if "image_url" in part else "image"
            url = part.get(key)
            if isinstance(url, dict):
                key, url = key + ".url", url.get("url")
            if not isinstance(url, str):
                raise Invalid("messages", "%s.%s must be a string, not %s"
                              % (at, key, _kind(url)))


def _check_messages(body):
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Invalid("messages", "messages must be a non-empty list of messages, not %s"
                      % ("an empty list" if messages == [] else _kind(messages)))
    for i, message in enumerate(messages):
        where = "messages[%d]" % i
        if not isinstance(message, dict):
            raise Invalid("messages", "%s must be an object, not %s" % (where, _kind(message)))
        if not isinstance(message.get("role"), str):
            raise Invalid("messages", "%s.role must be a string, not %s"
                          % (where, _kind(message.get("role"))))
        _check_content(message.get("content"), where + ".content")
        _list_of_objects_or_null(message.get("tool_calls"), where + ".tool_calls", "messages")
    _list_of_objects_or_null(body.get("tools"), "tools")
    _object_or_null(body.get("role_mapping"), "role_mapping")


def _check_prompt(handler, body, vocabulary):
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise Invalid("prompt", "prompt must be a string, not %s" % _kind(prompt))
    if len(prompt) > _SHORT_PROMPT:
        return
    tokenizer = vocabulary.tokenizer()
    if tokenizer is None:
        empty = prompt == ""
    else:
        empty = len(tokenizer.encode(prompt)) == 0
    if empty:
        raise Invalid("prompt", "prompt %r has no tokens for this model" % prompt)


def _check_ignored(body):
    """Fields stock ignores: only their JSON types."""
    if body.get("n") is not None:
        _int(body["n"], "n", low=1)
    response_format = body.get("response_format")
    if response_format is not None:
        _object_or_null(response_format, "response_format")
        if not isinstance(response_format.get("type"), str):
            raise Invalid("response_format", "response_format.type must be a string, not %s"
                          % _kind(response_format.get("type")))
    tool_choice = body.get("tool_choice")
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise Invalid("tool_choice", "tool_choice must be a string or an object, not %s"
                      % _kind(tool_choice))


def _check_sampling(handler, body, vocabulary):
    """The fields stock reads into attributes (its defaults when absent)."""
    _bool(handler.stream, "stream")
    if handler.stream:
        options = handler.stream_options
        _object_or_null(options, "stream_options")
        if options is not None and not isinstance(options.get("include_usage"), bool):
            raise Invalid("stream_options", "stream_options.include_usage must be true or "
                          "false, not %s" % _kind(options.get("include_usage")))
    if not isinstance(handler.requested_model, str):
        raise Invalid("model", "model must be a string, not %s" % _kind(handler.requested_model))
    _string_or_null(handler.adapter, "adapters")
    _string_or_null(handler.requested_draft_model, "draft_model")
    _int(handler.num_draft_tokens, "num_draft_tokens", low=0)
    tokens_field = ("max_completion_tokens" if body.get("max_completion_tokens") is not None
                    else "max_tokens")
    _int(handler.max_tokens, tokens_field, low=1)
    _number(handler.temperature, "temperature", low=0)
    _number(handler.top_p, "top_p", 0, 1)
    _int(handler.top_k, "top_k", low=0)
    _number(handler.min_p, "min_p", 0, 1)
    _number(handler.xtc_probability, "xtc_probability", 0, 1, floats_only=True)
    _number(handler.xtc_threshold, "xtc_threshold", 0, 1, floats_only=True)
    for penalty, size, low in (("repetition_penalty", "repetition_context_size", 0),
                               ("presence_penalty", "presence_context_size", None),
                               ("frequency_penalty", "frequency_context_size", None)):
        _number(getattr(handler, penalty), penalty, low=low)
        high = _SLICE_LIMIT - 1 if getattr(handler, penalty) else None
        _int(getattr(handler, size), size, low=0, high=high)
    _bool(handler.logprobs, "logprobs")
    if not (_is_int(handler.top_logprobs) and handler.top_logprobs == -1):
        _int(handler.top_logprobs, "top_logprobs", low=0, high=11)
    if handler.seed is not None:
        _int(handler.seed, "seed", low=0, high=_SEED_LIMIT - 1)
    _object_or_null(handler.chat_template_kwargs, "chat_template_kwargs")

    sampling = handler.temperature != 0  # else stock's sampler is argmax alone
    if sampling and handler.top_k > 0:
        size = vocabulary.size("top_k")
        if handler.top_k >= size:
            raise Invalid("top_k", "top_k must be below the vocabulary size %d of this model "
                          "(or 0 for no limit), not %d" % (size, handler.top_k))
    if sampling and handler.xtc_probability > 0:
        if _xtc_always_fails:
            raise Invalid("xtc_probability", "XTC sampling fails in this mlx-lm release "
                          "(it kills the generation thread); send xtc_probability 0")
        if handler.xtc_threshold > 0.5:
            raise Invalid("xtc_threshold", "xtc_threshold must be at most 0.5 when XTC "
                          "sampling runs, not %g" % handler.xtc_threshold)
    _check_logit_bias(handler.logit_bias, vocabulary)


def _check_logit_bias(bias, vocabulary):
    _object_or_null(bias, "logit_bias")
    if not bias:
        return
    size = None
    for key, value in bias.items():
        try:
            token = int(key)  # as stock reads it
        except (TypeError, ValueError):
            raise Invalid("logit_bias", "logit_bias keys must be token ids, not %r" % (key,)) \
                from None
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise Invalid("logit_bias", "logit_bias[%r] must be a number, not %s"
                          % (key, _kind(value))) from None
        if not math.isfinite(number):
            raise Invalid("logit_bias", "logit_bias[%r] must be a finite number, not %r"
                          % (key, value))
        if size is None:
            size = vocabulary.size("logit_bias")
        if not 0 <= token < size:
            raise Invalid("logit_bias", "logit_bias key %r is not a token id of this model "
                          "(0 to %d)" % (key, size - 1))


# -- the vocabulary the request will meet ------------------------------------------


class _KeyOnly:
    """Stands in for the ModelProvider so that stock's own load() logic says
    which model key a request resolves to, without loading anything."""

    def __init__(self, provider):
        self._model_map = getattr(provider, "_model_map", {})
        self._adapter_map = getattr(provider, "_adapter_map", {})
        self._draft_model_map = getattr(provider, "_draft_model_map", {})
        self.model_key = object()  # equal to nothing: load() calls _load(*key)
        self.model = self.tokenizer = None
        self.key = None

    def _load(self, *key):
        self.key = key


def _config_vocab_size(config):
    for source in (config, config.get("text_config") or {}):
        size = source.get("vocab_size") if isinstance(source, dict) else None
        if _is_int(size) and size > 0:
            return size
    return None


def _args_vocab_size(model):
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if _is_int(size) and size > 0:
        return size
    text = getattr(args, "text_config", None)
    if isinstance(text, dict):
        return _config_vocab_size(text)
    size = getattr(text, "vocab_size", None)
    return size if _is_int(size) and size > 0 else None


def _config_of(path):
    """The config.json of a model folder or Hugging Face repo (cache only), or {}."""
    import os

    if not isinstance(path, str):
        return {}
    candidates = [os.path.join(os.path.expanduser(path), "config.json")]
    if not os.path.isdir(os.path.expanduser(path)):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
            if isinstance(cached, str):
                candidates.append(cached)
        except Exception:  # noqa: BLE001 - not a repo id, no hub library: unknown
            pass
    for candidate in candidates:
        try:
            with open(candidate) as handle:
                config = json.load(handle)
            if isinstance(config, dict):
                return config
        except (OSError, ValueError):
            continue
    return {}


class _Vocabulary:
    """What the model that will serve this request knows, looked up once, lazily."""

    def __init__(self, handler):
        self._handler = handler
        self._looked = False
        self._size = None
        self._tokenizer = None

    def _look(self):
        if self._looked:
            return
        self._looked = True
        handler = self._handler
        provider = getattr(getattr(handler, "response_generator", None), "model_provider", None)
        if provider is None:
            return
        stand_in = _KeyOnly(provider)
        try:
            load = getattr(type(provider).load, "__wrapped__", None) or type(provider).load
            while hasattr(load, "__wrapped__"):
                load = load.__wrapped__
            load(stand_in, handler.requested_model, handler.adapter,
                 handler.requested_draft_model)
        except Exception:  # noqa: BLE001 - an unhashable name: unknown, stock says why
            return
        key = stand_in.key
        model, tokenizer = provider.model, provider.tokenizer
        if key is not None and key == provider.model_key and model is not None:
            self._tokenizer = tokenizer
            self._size = _args_vocab_size(model)
        if self._size is None and key:
            self._size = _config_vocab_size(_config_of(key[0]))

    def size(self, param):
        self._look()
        if self._size is None:
            raise Invalid(param, "%s cannot be checked against the vocabulary of a model that "
                          "is not loaded yet; send it once the model is loaded" % param)
        return self._size

    def tokenizer(self):
        self._look()
        return self._tokenizer


def check(handler):
    """Raise Invalid for the first bad field of handler's request."""
    body = handler.body
    vocabulary = _Vocabulary(handler)
    _check_sampling(handler, body, vocabulary)
    _check_stop(body)
    _check_ignored(body)
    path = getattr(handler, "path", "")
    if path.endswith("/chat/completions"):
        _check_messages(body)
    elif path.endswith("/completions"):
        _check_prompt(handler, body, vocabulary)


def refuse(handler, invalid):
    send_json(handler, 400, {"error": {"message": invalid.message,
                                       "type": "invalid_request_error",
                                       "param": invalid.param, "code": 400}})


# -- the wrappers ------------------------------------------------------------------


_said_broken = False


def _wrap_validate(original):
    def validate_model_parameters(self, *args, **kwargs):
        global _said_broken
        try:
            check(self)
        except Invalid as invalid:
            try:
                refuse(self, invalid)
            except OSError:
                pass  # the client left
            raise _Refused() from None
        except Exception as error:  # noqa: BLE001 - a check that breaks leaves stock as it is
            if not _said_broken:
                _said_broken = True
                log.say("validate: a check failed (%s: %s); this request goes to stock "
                        "unchecked (said once)" % (error.__class__.__name__, error))
                log.debug_exception()
        return original(self, *args, **kwargs)

    return _wrap(original, validate_model_parameters, NAME)


def _wrap_do_post(original):
    def do_POST(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except _Refused:
            return None  # answered 400; nothing more to do for this request

    return _wrap(original, do_POST, NAME)


# -- gate and apply ------------------------------------------------------------------


# How stock reads the request in do_POST, verbatim: the fields this part checks
# reach handle_completion through these lines.
_DO_POST_SHAPE = (
    "self.body = json.loads(",
    "self.validate_model_parameters()",
    'stop_words = self.body.get("stop")',
    "request = request_factories[self.path]()",
)


def check_shape(server):
    handler = getattr(server, "APIHandler", None)
    if handler is None:
        return "mlx_lm.server has no APIHandler"
    for name in ("do_POST", "validate_model_parameters", "handle_completion"):
        if not callable(getattr(handler, name, None)):
            return "APIHandler.%s is missing" % name
    if wrapped_by(handler.validate_model_parameters, NAME):
        return "already applied"
    source = source_of(handler.do_POST)
    if source is None:
        return "cannot read the source of APIHandler.do_POST"
    missing = [line for line in _DO_POST_SHAPE if line not in flat(source)]
    if missing:
        return "APIHandler.do_POST no longer reads the request as this expects (%s)" % missing[0]
    return None


def _xtc_special_tokens_nested(server):
    """0.31.x builds XTC's special tokens as [eos_id, tokenizer.encode("\\n")]:
    a list inside the list, which makes every XTC sampling raise."""
    source = source_of(getattr(server, "_make_sampler", None))
    return source is not None and (
        '[ tokenizer.eos_token_id, tokenizer.encode("\\n"), ]' in flat(source))


def apply(server):
    global _xtc_always_fails
    handler = server.APIHandler
    replacements = [
        (handler, "validate_model_parameters",
         _wrap_validate(handler.validate_model_parameters)),
        (handler, "do_POST", _wrap_do_post(handler.do_POST)),
    ]
    xtc = _xtc_special_tokens_nested(server)
    for owner, name, value in replacements:
        setattr(owner, name, value)
    _xtc_always_fails = xtc
