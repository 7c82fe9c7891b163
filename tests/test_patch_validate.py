"""validate: one request cannot take the server down (issue 18, item 1).

On the real stock 0.31.3 and 0.32.2 servers: one ``"stop": [["x"]]`` or
``"stop": ["a", 5]`` kills the generation thread (a zombie without the shim,
exit 70 with the ``exit`` part); with ``validate`` every such field is
answered 400 naming it, valid requests are answered exactly as stock answers
them, and a seeded fuzz of the request body (harness/fuzz.py) kills nothing.
One shim server and one stock server per release, shared by the tests here.
"""

from __future__ import annotations

import json

import pytest
import requests

from harness.fuzz import CHAT, TEXT, bodies
from harness.server import VERSIONS, StockServer, sse_events

pytestmark = pytest.mark.server

TIMEOUT = 60
DIED = "generation thread died"


@pytest.fixture(scope="module")
def started(tmp_path_factory, tiny_llama, envs):
    """started(version, shim=True): one warm server of each kind per release."""
    servers = {}

    def get(version, shim=True):
        key = (version, shim)
        if key not in servers:
            folder = tmp_path_factory.mktemp("validate-%s-%s" % (version, shim))
            server = StockServer(version, tiny_llama, folder, shim=shim)
            servers[key] = server.start()
            server.warm_up()
        return servers[key]

    yield get
    for server in servers.values():
        server.stop()


def post(server, path, body, *, stream=False):
    return requests.post(server.url + path, data=json.dumps(body, allow_nan=True),
                         headers={"Content-Type": "application/json"}, timeout=TIMEOUT,
                         stream=stream)


def chat_body(**fields):
    body = {"model": "default_model", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4, "temperature": 0.0}
    body.update(fields)
    return body


def text_body(**fields):
    body = {"model": "default_model", "prompt": "once upon", "max_tokens": 4,
            "temperature": 0.0}
    body.update(fields)
    return body


# -- the bug, on stock ------------------------------------------------------------

# Each bad stop, on each release, once as stock (a zombie) and once with the
# exit part on and validate off (exit 70).
STOP_DEATHS = {"0.31.3": (["a", 5], [["x"]]), "0.32.2": ([["x"]], ["a", 5])}


STOCK_ERRORS = {repr(["a", 5]): "ValueError: text input must be of type `str`",
                repr([["x"]]): "TypeError: unhashable type: 'list'"}


@pytest.mark.parametrize("version", VERSIONS)
def test_one_bad_stop_kills_the_stock_generation_thread(servers, tiny_llama, version):
    as_stock, with_exit = STOP_DEATHS[version]
    stock = servers(version, tiny_llama, shim=False)
    stock.warm_up()
    if version == "0.31.3":  # the thread dies into the excepthook: every client waits
        for stop in (as_stock, None):
            with pytest.raises(requests.Timeout):
                stock.chat("x", max_tokens=2, stop=stop, timeout=15)
    else:  # _run_generate catches the death: every request fails, for good
        for stop in (as_stock, None):
            failed = stock.chat("x", max_tokens=2, stop=stop, timeout=TIMEOUT)
            assert failed.status_code == 404 and DIED in failed.text, failed.text
    assert STOCK_ERRORS[repr(as_stock)] in stock.log()
    assert stock.alive()  # a zombie: nothing restarts it

    exiting = servers(version, tiny_llama, env={"MLX_HOTFIX_DISABLE": "validate"})
    exiting.warm_up()
    assert "validate disabled" in exiting.hotfix_lines()[-1]
    dying = exiting.chat("x", max_tokens=2, stop=with_exit, timeout=TIMEOUT)
    assert dying.status_code == 503 and DIED in dying.text
    assert exiting.wait_exit(TIMEOUT) == 70, exiting.log()
    assert STOCK_ERRORS[repr(with_exit)] in exiting.log()


# -- valid requests: exactly as stock ----------------------------------------------

# Each is valid and served correctly by stock: nothing here may be refused.
VALID = [
    (CHAT, chat_body(stop="")),
    (CHAT, chat_body(stop=[""])),
    (CHAT, chat_body(stop=["zz", "\n\n"])),
    (CHAT, chat_body(top_k=10 ** 6)),  # greedy: no top-k sampler
    (CHAT, chat_body(top_k=299, temperature=0.8, seed=3)),
    (CHAT, chat_body(logit_bias={"5": 2.5, "299": -100, " 7 ": 1})),
    (CHAT, chat_body(xtc_probability=0.5, xtc_threshold=0.9)),  # greedy: no XTC
    (CHAT, chat_body(presence_context_size=2 ** 40)),  # no presence penalty
    (CHAT, chat_body(repetition_penalty=1.2, repetition_context_size=2 ** 31 - 1)),
    (CHAT, chat_body(presence_penalty=-0.5, frequency_penalty=0.7)),
    (CHAT, chat_body(stream=True, stream_options={"include_usage": True})),
    (CHAT, chat_body(stream=True, stream_options=None)),
    (CHAT, chat_body(stream=False, stream_options={})),  # stock reads it only when streaming
    (CHAT, chat_body(n=1, response_format={"type": "text"}, tool_choice="auto", tools=[],
                     user="someone")),
    (CHAT, {**chat_body(max_completion_tokens=3), "max_tokens": 1000}),  # the first wins
    (CHAT, chat_body(messages=[{"role": "system", "content": "be brief"},
                               {"role": "user", "content": [{"type": "text", "text": "hi"}]}])),
    (CHAT, chat_body(seed=2 ** 64 - 1, temperature=0.5, logprobs=True, top_logprobs=3)),
    (CHAT, chat_body(draft_model=None, adapters=None, chat_template_kwargs={})),
    (TEXT, text_body(prompt=" ")),
    (TEXT, text_body(stop="\n", top_p=0.5, min_p=0.1, temperature=0.7, seed=11)),
]
VALID_032 = [  # XTC works on 0.32 (0.31 kills on any XTC: refused there, below)
    (CHAT, chat_body(xtc_probability=0.5, xtc_threshold=0.1, temperature=0.8, seed=1)),
]


def _answer(response, stream):
    """What a client gets, less the request id, time and fingerprint."""
    if response.status_code != 200:
        return response.status_code, response.text
    if stream:
        events = [e for e in sse_events(response.content) if isinstance(e, dict)]
        text = "".join(c.get("delta", {}).get("content") or ""
                       for e in events for c in e.get("choices", []))
        finish = [c["finish_reason"] for e in events for c in e.get("choices", [])
                  if c.get("finish_reason")]
        usage = [{k: v for k, v in e["usage"].items() if k != "prompt_tokens_details"}
                 for e in events if e.get("usage")]
        return 200, text, finish, usage, sse_events(response.content)[-1]
    body = response.json()
    usage = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return 200, body["choices"], usage


@pytest.mark.parametrize("version", VERSIONS)
def test_valid_requests_are_answered_exactly_as_stock(started, version):
    shim, stock = started(version), started(version, shim=False)
    assert "validate applied" in shim.hotfix_lines()[0]
    for path, body in VALID + (VALID_032 if version == "0.32.2" else []):
        stream = bool(body.get("stream"))
        expected = _answer(post(stock, path, body, stream=stream), stream)
        got = _answer(post(shim, path, body, stream=stream), stream)
        assert expected[0] == 200, (body, expected)
        assert got == expected, body


# -- every field that would kill, refused ---------------------------------------------

SAMPLING = {"temperature": 0.8}
REFUSED = [
    # (path, body, param, words of the message)
    (CHAT, chat_body(stop=[["x"]]), "stop", "stop[0] must be a string, not list"),
    (CHAT, chat_body(stop=["a", 5]), "stop", "stop[1] must be a string, not int"),
    (CHAT, chat_body(stop=5), "stop", "stop must be a string or a list of strings"),
    (CHAT, chat_body(stop={"a": 1}), "stop", "stop must be a string or a list of strings"),
    (CHAT, chat_body(top_k=300, **SAMPLING), "top_k",
     "top_k must be below the vocabulary size 300 of this model"),
    (CHAT, chat_body(top_logprobs=True), "top_logprobs", "top_logprobs must be an integer"),
    (CHAT, chat_body(min_p=float("nan"), **SAMPLING), "min_p", "must be a finite number"),
    (CHAT, chat_body(temperature=float("inf")), "temperature", "must be a finite number"),
    (CHAT, chat_body(temperature=10 ** 400), "temperature", "must be within 64 bits"),
    (CHAT, chat_body(presence_penalty=2 ** 63), "presence_penalty", "must be within 64 bits"),
    (CHAT, chat_body(repetition_penalty=1.1, repetition_context_size=2 ** 31),
     "repetition_context_size", "must be at most 2147483647"),
    (CHAT, chat_body(frequency_penalty=0.5, frequency_context_size=-1),
     "frequency_context_size", "must be at least 0"),
    (CHAT, chat_body(logit_bias={"300": 1}), "logit_bias",
     "logit_bias key '300' is not a token id of this model (0 to 299)"),
    (CHAT, chat_body(logit_bias={"99999999999": 1}), "logit_bias", "is not a token id"),
    (CHAT, chat_body(logit_bias={"-1": 1}), "logit_bias", "is not a token id"),
    (CHAT, chat_body(logit_bias={"x": 1}), "logit_bias", "keys must be token ids"),
    (CHAT, chat_body(logit_bias={"5": [1]}), "logit_bias", "must be a number"),
    (CHAT, chat_body(logit_bias={"5": 10 ** 400}), "logit_bias", "must be a number"),
    (CHAT, chat_body(seed=-1), "seed", "seed must be at least 0"),
    (CHAT, chat_body(seed=2 ** 64), "seed", "seed must be at most 18446744073709551615"),
    (CHAT, chat_body(max_tokens=0), "max_tokens", "max_tokens must be at least 1"),
    (CHAT, chat_body(max_completion_tokens=-1), "max_completion_tokens", "at least 1"),
    (CHAT, chat_body(max_tokens=True), "max_tokens", "must be an integer, not bool"),
    (CHAT, chat_body(stream=True, stream_options={}), "stream_options",
     "stream_options.include_usage must be true or false"),
    (CHAT, chat_body(stream="yes"), "stream", "stream must be true or false"),
    (CHAT, chat_body(messages=[]), "messages", "messages must be a non-empty list"),
    (CHAT, chat_body(messages="hi"), "messages", "messages must be a non-empty list"),
    (CHAT, chat_body(messages=[{"content": "x"}]), "messages", "messages[0].role must be"),
    (CHAT, chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
     "messages", "messages[0].content[0].text must be a string"),
    (CHAT, chat_body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": 5}}]}]),
     "messages", "messages[0].content[0].image_url.url must be a string"),
    (CHAT, chat_body(tools="x"), "tools", "tools must be a list"),
    (CHAT, chat_body(draft_model=["x"]), "draft_model", "draft_model must be a string"),
    (CHAT, chat_body(chat_template_kwargs=[1]), "chat_template_kwargs", "must be an object"),
    (CHAT, chat_body(n="x"), "n", "n must be an integer"),
    (CHAT, chat_body(response_format=5), "response_format", "must be an object"),
    (CHAT, chat_body(tool_choice=5), "tool_choice", "must be a string or an object"),
    (CHAT, chat_body(model=5), "model", "model must be a string"),
    (TEXT, text_body(prompt=""), "prompt", "prompt '' has no tokens for this model"),
    (TEXT, text_body(prompt=[1, 2]), "prompt", "prompt must be a string, not list"),
    (TEXT, {"max_tokens": 2}, "prompt", "prompt must be a string, not null"),
]
REFUSED_BY_RELEASE = {
    "0.31.3": [(CHAT, chat_body(xtc_probability=0.5, xtc_threshold=0.1, **SAMPLING),
                "xtc_probability", "XTC sampling fails in this mlx-lm release")],
    "0.32.2": [(CHAT, chat_body(xtc_probability=0.5, xtc_threshold=0.6, **SAMPLING),
                "xtc_threshold", "xtc_threshold must be at most 0.5 when XTC sampling runs")],
}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_field_that_would_kill_is_refused_400_naming_it(started, version):
    server = started(version)
    for path, body, param, words in REFUSED + REFUSED_BY_RELEASE[version]:
        response = post(server, path, body)
        assert response.status_code == 400, (body, response.status_code, response.text)
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error", param, 400), (body, error)
        assert words in error["message"], (body, error)
    assert post(server, CHAT, chat_body()).status_code == 200
    assert server.alive() and DIED not in server.log()


def test_before_the_model_is_loaded_the_vocabulary_comes_from_its_config(servers, tiny_llama,
                                                                         tmp_path):
    from harness.server import BackgroundRequest
    from tests.conftest import fault_env

    release = tmp_path / "release"
    env = dict(fault_env("hold:load"), MLX_TEST_FAULT_RELEASE_FILE=str(release))
    server = servers("0.32.2", tiny_llama, env=env)
    server.wait_listening()
    early = post(server, CHAT, chat_body(logit_bias={"300": 1}))  # config.json: 300 tokens
    assert early.status_code == 400 and "(0 to 299)" in early.json()["error"]["message"]
    assert post(server, TEXT, text_body(prompt="")).status_code == 400
    waiting = BackgroundRequest(lambda: post(server, CHAT, chat_body(logit_bias={"299": 1})))
    release.touch()
    assert waiting.join(TIMEOUT) and waiting.status == 200, waiting


# -- the fuzz ----------------------------------------------------------------------

FUZZ_SEED = 18
FUZZ_REQUESTS = 2000


@pytest.mark.parametrize("version", VERSIONS)
def test_no_request_body_kills_the_generation_thread(started, version):
    # The exit part is on: a death answers 503 "generation thread died" and the
    # process exits 70; a crash (SIGSEGV) ends it too. Either fails here with
    # the body that did it.
    server = started(version)
    seen = {}
    for i, (path, data, body) in enumerate(bodies(FUZZ_SEED, FUZZ_REQUESTS)):
        try:
            response = requests.post(server.url + path, data=data, timeout=TIMEOUT,
                                     headers={"Content-Type": "application/json"})
            outcome = response.status_code
            died = outcome == 503 and DIED in response.text
        except requests.RequestException as error:
            outcome, died = type(error).__name__, False
        seen[outcome] = seen.get(outcome, 0) + 1
        assert not died and server.alive(), (
            "request %d killed the server: %s %r\n%s" % (i, path, body, server.log()[-3000:]))
    assert post(server, CHAT, chat_body()).status_code == 200
    assert server.alive() and DIED not in server.log(), server.log()[-3000:]
    assert seen.get(200, 0) > FUZZ_REQUESTS // 20 and seen.get(400, 0) > FUZZ_REQUESTS // 2, seen
