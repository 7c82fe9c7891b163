"""Quick checks of the tiny on-disk models in harness/tinymodel.py."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx_lm.utils as mlx_lm_utils
import pytest

from harness import tinymodel


def _chat_prompt(tok):
    return tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True
    )


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tinymodel.build_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory):
    return tinymodel.build_qwen3_next(tmp_path_factory.mktemp("qwen3_next"))


def test_tokenizer_loads_with_chat_template_and_eos(llama_dir):
    _, tok = mlx_lm_utils.load(str(llama_dir))
    assert tok.eos_token == tinymodel.EOS_TOKEN
    assert tok.eos_token_id is not None and tok.eos_token_id in tok.eos_token_ids
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == "<|user|>hello\n<|assistant|>"
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == (
        "hello world"
    )


def test_llama_generates_full_length(llama_dir):
    from mlx_lm.generate import generate, stream_generate

    model, tok = mlx_lm_utils.load(str(llama_dir))
    text = generate(model, tok, "hello world", max_tokens=8)
    assert isinstance(text, str) and text
    responses = list(stream_generate(model, tok, _chat_prompt(tok), max_tokens=40))
    assert len(responses) == 40
    assert responses[-1].finish_reason == "length"
    assert all(r.token not in tok.eos_token_ids for r in responses)
    out = "".join(r.text for r in responses)
    assert all(c == "\n" or " " <= c <= "~" for c in out), repr(out)


def test_qwen3_next_batch_generator_matches_generate_step(qwen3_next_dir):
    from mlx_lm.generate import stream_generate

    model, tok = mlx_lm_utils.load(str(qwen3_next_dir))
    assert [l.is_linear for l in model.layers] == [True, True, True, False]
    prompt = _chat_prompt(tok)
    batched = tinymodel.decode_tokens(model, prompt, 24)
    single = [r.token for r in stream_generate(model, tok, prompt, max_tokens=24)]
    assert len(batched) == 24
    assert batched == single
    assert not set(batched) & set(tok.eos_token_ids)


def test_builds_are_deterministic(tmp_path):
    a = tinymodel.build_llama(tmp_path / "a", seed=7)
    b = tinymodel.build_llama(tmp_path / "b", seed=7)
    c = tinymodel.build_llama(tmp_path / "c", seed=8)

    def read(d, f):
        return (d / f).read_bytes()

    assert read(a, "model.safetensors") == read(b, "model.safetensors")
    assert read(a, "tokenizer.json") == read(b, "tokenizer.json")
    assert read(a, "model.safetensors") != read(c, "model.safetensors")
