"""Tiny random-weight models on disk, loadable by stock ``mlx_lm``.

Builds a ``llama`` or a hybrid ``qwen3_next`` (gated-delta linear attention plus
full attention every Nth layer, MoE MLPs) into a directory that
``mlx_lm.utils.load(dir)`` and ``mlx_lm.server --model dir`` accept offline, in
both mlx-lm 0.31.x and 0.32.x. Nothing is downloaded: the tokenizer is a
byte-level BPE trained in-process on a built-in corpus.

Properties the tests rely on:

* Deterministic: same ``seed`` -> byte-identical ``model.safetensors`` and
  ``tokenizer.json`` (weights come from a numpy RNG, not ``mx.random``).
* EOS never ends a completion early, and the output is printable ASCII: the
  weights carry a constant residual channel whose value after the final norm is
  always positive, and the ``lm_head`` rows of banned tokens (``<s>``,
  ``</s>`` and every token that is not printable ASCII/newline) read only that
  channel with a large negative weight. Their logits are therefore always
  strongly negative (< -15, typically ~ -40) while the best allowed logit is
  positive, so neither greedy nor temperature sampling picks them: a request
  for N tokens yields exactly N tokens (finish_reason "length").

CLI::

    python harness/tinymodel.py {llama,qwen3_next} OUT_DIR [--layers N] [--seed S]

Only depends on mlx, mlx_lm, numpy, tokenizers and the stdlib.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Std of the allowed tokens' logits (roughly). Large, so the distribution is
# peaked and banned tokens (negative logit) are never sampled in practice.
LOGIT_SCALE = 4.0
# Constant value of residual channel 0 in every embedding (see _init_weights).
BIAS_CHANNEL_VALUE = 8.0
# lm_head weight on channel 0 for banned tokens (specials, non-printable bytes).
BANNED_LOGIT_WEIGHT = 16.0
# Projections that write into the residual stream (their output row 0 is zero).
_RESIDUAL_WRITERS = {"o_proj", "out_proj", "down_proj"}

_CORPUS = """\
hello world. Hello, World! hello there, how are you today? I am fine, thank you.
The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.
user assistant system: you are a helpful assistant. Please answer the question.
What is 2 + 2? It is 4. What is 10 * 3? It is 30. Count: 0 1 2 3 4 5 6 7 8 9 10.
Numbers like 42, 3.14, 1000, 2025 and 99% show up in text (often in lists).
Let's write some code: def main(): print("hello world") # done [ok] {yes} <no>
Questions? Answers! Commas, periods. Colons: semicolons; dashes - and quotes "x" 'y'.
the of and to in is it that was for on are with as be at this have from or one
had by word but not what all were we when your can said there use an each which
she do how their if will up other about out many then them these so some her
would make like him into time has look two more write go see number no way could
people my than first water been call who oil its now find long down day did get
come made may part over new sound take only little work know place year live me
back give most very after thing our just name good sentence man think say great
where help through much before line right too mean old any same tell boy follow
came want show also around form three small set put end does another well large
must big even such because turn here why ask went men read need land different
home us move try kind hand picture again change off play spell air away animal
house point page letter mother answer found study still learn should world high
"""


def _corpus_lines() -> List[str]:
    lines = [ln for ln in _CORPUS.splitlines() if ln.strip()]
    # Repeat so frequent pairs are clearly frequent and the merges are stable.
    return lines * 4


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def build_tokenizer(out_dir: Path, vocab_size: int = 300) -> None:
    """Train a byte-level BPE and write HF tokenizer files into ``out_dir``.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` (with a Jinja
    ``chat_template``, ``<s>``/``</s>`` as bos/eos, class
    ``PreTrainedTokenizerFast``) and ``special_tokens_map.json``. Ids 0 and 1
    are ``<s>`` and ``</s>``. The real vocabulary size (see
    :func:`tokenizer_vocab_size`; the builders size the model to it) is
    ``max(vocab_size, 260)``, or less if the small corpus runs out of merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(int(vocab_size), 260),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))

    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1000000,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(
        out_dir / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN},
    )


def tokenizer_vocab_size(out_dir: Path) -> int:
    """Number of ids in the ``tokenizer.json`` written by :func:`build_tokenizer`."""
    data = json.loads((Path(out_dir) / "tokenizer.json").read_text())
    ids = set(data["model"]["vocab"].values())
    ids.update(t["id"] for t in data.get("added_tokens", []))
    return max(ids) + 1


def _special_token_ids(out_dir: Path) -> Dict[str, int]:
    data = json.loads((Path(out_dir) / "tokenizer.json").read_text())
    return {t["content"]: t["id"] for t in data.get("added_tokens", [])}


# --------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------


def _printable_token_ids(out_dir: Path) -> List[int]:
    """Ids whose text is printable ASCII (or newline) and not a special token."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(out_dir) / "tokenizer.json"))
    specials = set(_special_token_ids(out_dir).values())
    ok = []
    for i in range(tok.get_vocab_size()):
        if i in specials:
            continue
        text = tok.decode([i])
        if text and all(c == "\n" or " " <= c <= "~" for c in text):
            ok.append(i)
    return ok


def _init_weights(
    model_module,
    config: Dict[str, Any],
    seed: int,
    allowed_ids: Sequence[int],
    dtype: str,
) -> Dict[str, "Any"]:
    """Deterministic random weights named exactly as ``model.parameters()``.

    Residual channel 0 is a constant "bias" channel: every embedding has
    ``BIAS_CHANNEL_VALUE`` there and every residual writer (``o_proj``,
    ``out_proj``, ``down_proj``) has a zero output row 0, so after the final
    RMSNorm ``h[0] > 0`` for every position. ``lm_head`` rows of tokens not in
    ``allowed_ids`` are ``-BANNED_LOGIT_WEIGHT * e0``: their logit is strictly
    negative (about -BANNED_LOGIT_WEIGHT * h[0]) no matter the input, while the
    allowed rows are random with column 0 zero.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    args = model_module.ModelArgs.from_dict(config)
    model = model_module.Model(args)
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    hidden = int(config["hidden_size"])
    allowed = np.zeros(int(config["vocab_size"]), dtype=bool)
    allowed[list(allowed_ids)] = True

    rng = np.random.default_rng(seed)
    weights = {}
    for name in sorted(shapes):
        shape = shapes[name]
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("A_log"):
            w = np.log(rng.uniform(1.0, 16.0, size=shape))
        elif name.endswith("dt_bias"):
            w = np.ones(shape)
        elif leaf == "bias":
            w = np.zeros(shape)
        elif len(shape) == 1:
            # RMSNorm weights (mlx-format: the multiplier itself).
            w = np.ones(shape)
        elif "embed_tokens" in name:
            w = rng.normal(0.0, 1.0, size=shape)
            w[:, 0] = BIAS_CHANNEL_VALUE
        elif name == "lm_head.weight":
            w = rng.normal(0.0, LOGIT_SCALE / np.sqrt(shape[-1] - 1), size=shape)
            w[:, 0] = 0.0
            w[~allowed] = 0.0
            w[~allowed, 0] = -BANNED_LOGIT_WEIGHT
        else:
            fan_in = int(np.prod(shape[1:])) if "conv1d" in name else shape[-1]
            w = rng.normal(0.0, 1.0 / np.sqrt(fan_in), size=shape)
            if leaf == "weight" and name.rsplit(".", 2)[-2] in _RESIDUAL_WRITERS:
                assert shape[-2] == hidden, (name, shape)
                w[..., 0, :] = 0.0
        weights[name] = mx.array(w.astype(np.float32)).astype(getattr(mx, dtype))
    mx.eval(weights)

    # Round-trip check: the model must accept exactly these names and shapes.
    model.load_weights(list(weights.items()), strict=True)
    if hasattr(model, "sanitize"):
        sanitized = model.sanitize(dict(weights))
        if set(sanitized) != set(weights):
            raise RuntimeError("sanitize() renamed weights; saved format is wrong")
    return weights


def _write_model(
    out_dir: Path,
    model_type: str,
    config: Dict[str, Any],
    seed: int,
    vocab_size: Optional[int],
    dtype: str,
) -> Path:
    import importlib

    import mlx.core as mx

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir, vocab_size=vocab_size or 300)
    specials = _special_token_ids(out_dir)
    allowed_ids = _printable_token_ids(out_dir)
    config = dict(config)
    config["vocab_size"] = tokenizer_vocab_size(out_dir)
    config["bos_token_id"] = specials[BOS_TOKEN]
    config["eos_token_id"] = specials[EOS_TOKEN]
    config["torch_dtype"] = dtype

    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    weights = _init_weights(module, config, seed, allowed_ids, dtype)
    mx.save_safetensors(
        str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"}
    )
    _write_json(out_dir / "config.json", config)
    return out_dir


def _write_json(path: Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------


def build_llama(
    out_dir: Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    vocab_size=None,
    dtype: str = "float32",
) -> Path:
    """Tiny random ``llama`` (4 heads, 2 kv heads, MLP 2*hidden). Returns ``out_dir``."""
    num_heads = 4
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": 2,
        "head_dim": hidden_size // num_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_traditional": False,
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    return _write_model(Path(out_dir), "llama", config, seed, vocab_size, dtype)


def build_qwen3_next(
    out_dir: Path,
    *,
    seed: int = 0,
    num_layers: int = 4,
    full_attention_interval: int = 4,
    hidden_size: int = 64,
    vocab_size=None,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    linear_head_dim: int = 32,
    dtype: str = "float32",
) -> Path:
    """Tiny random hybrid ``qwen3_next``. Returns ``out_dir``.

    Layer ``i`` is full attention iff ``(i + 1) % full_attention_interval == 0``,
    otherwise gated-delta linear attention; every layer has a sparse MoE MLP
    (``num_experts`` experts, top ``num_experts_per_tok``, plus a shared expert).
    ``num_layers`` must be >= ``full_attention_interval`` (mlx-lm 0.31 indexes
    the first full-attention layer's cache unconditionally). Benchmark variant:
    ``num_layers=48, full_attention_interval=4`` -> 36 linear + 12 full layers.
    ``linear_head_dim`` stays a multiple of 32 so the Metal gated-delta kernel
    accepts it.
    """
    if num_layers < full_attention_interval:
        raise ValueError("num_layers must be >= full_attention_interval")
    num_heads = 4
    head_dim = hidden_size // num_heads
    config = {
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": linear_head_dim,
        "linear_value_head_dim": linear_head_dim,
        "linear_conv_kernel_dim": 4,
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": hidden_size,
        "moe_intermediate_size": hidden_size // 2,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "full_attention_interval": full_attention_interval,
    }
    return _write_model(Path(out_dir), "qwen3_next", config, seed, vocab_size, dtype)


# --------------------------------------------------------------------------
# Decoding helper
# --------------------------------------------------------------------------


def decode_tokens(model, prompt_tokens: Sequence[int], n: int) -> List[int]:
    """Greedy-decode ``n`` tokens for one prompt through ``BatchGenerator``.

    Uses only the API common to mlx-lm 0.31.x and 0.32.x: the constructor with
    ``max_tokens`` (no ``stop_tokens``, so EOS cannot stop it; the default
    sampler is argmax), ``insert(prompts, max_tokens)`` and
    ``next_generated()`` which returns ``GenerationBatch.Response`` objects
    with ``uid``/``token``/``finish_reason`` in both versions.
    """
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=n)
    try:
        (uid,) = gen.insert([list(prompt_tokens)], [n])
        out: List[int] = []
        while responses := gen.next_generated():
            for r in responses:
                if r.uid != uid:
                    continue
                if r.finish_reason != "stop":
                    out.append(int(r.token))
                if r.finish_reason is not None:
                    return out
        return out
    finally:
        gen.close()


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=["llama", "qwen3_next"])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--layers", type=int, default=None, help="num_hidden_layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--full-attention-interval", type=int, default=4, help="qwen3_next only"
    )
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    if a.kind == "llama":
        kw = {} if a.layers is None else {"num_layers": a.layers}
        out = build_llama(a.out_dir, seed=a.seed, **kw)
    else:
        kw = {} if a.layers is None else {"num_layers": a.layers}
        out = build_qwen3_next(
            a.out_dir,
            seed=a.seed,
            full_attention_interval=a.full_attention_interval,
            **kw,
        )
    print(out)
    print(f"built in {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
