"""Figure 5: memory growth per 10k decode tokens on a hybrid model, stock vs
patched ArraysCache.advance.

A bigger tiny qwen3_next (default 48 layers, full attention every 4th: 36
gated-delta linear layers, each with an ArraysCache) is decoded greedily
through the real BatchGenerator, one subprocess per variant, back to back:

    stock    no PYTHONPATH            (stock advance: `lengths -= N;
                                        left_padding -= N`, one lazy node per
                                        step per linear layer, never evaluated)
    patched  PYTHONPATH=sitecustomize (the advance patch)

bench/advance_growth_probe.py samples RSS, mx.get_active_memory() and
mx.get_cache_memory() every K tokens, and at the end times reading +
mx.eval of every linear layer's stale lengths/left_padding. Growth per 10k
tokens is the least-squares slope over the decoded tokens, times 10,000,
of RSS, of MLX's buffers (active + cache: the KV cache lands there, in both
variants), and of the rest of RSS, outside MLX's buffers, where the stale
graph's nodes live (one per step per linear layer, so linear). A second
table runs N advance() calls on a lone ArraysCache (no model) and times one
mx.eval afterwards, in both venvs.
Goal: patched flat.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    BENCH,
    MAIN_VERSION,
    VERSIONS,
    Figure,
    build_model,
    env_python,
    fmt,
    linear_slope,
    run_main,
    table,
    temp_dir,
)
from tests.support.server import base_env

PROBE = BENCH / "advance_growth_probe.py"
MB = 1024 * 1024
VARIANTS = ("stock", "patched")


def run_probe(fig: Figure, version: str, variant: str, model: Path, tokens: int,
              sample_every: int, micro: str, log_dir: Path) -> dict:
    env = base_env(shim=variant == "patched")
    cmd = [str(env_python(version)), str(PROBE), str(model), str(tokens),
           "--sample-every", str(sample_every), "--micro", micro]
    log = log_dir / f"probe-{version}-{variant}.log"
    with open(log, "w") as err:
        result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                timeout=4 * 3600, start_new_session=True)
    if result.returncode != 0:
        raise RuntimeError(f"probe {version} {variant} failed ({result.returncode}):\n"
                           f"{log.read_text()[-3000:]}")
    data = json.loads(result.stdout.strip().splitlines()[-1])
    patched = data["variant"]["left_padding_is_descriptor"]
    if patched != (variant == "patched"):
        raise RuntimeError(f"probe {version} {variant}: advance patched={patched}: {data['variant']}")
    return data


def growth(decode: dict) -> dict:
    samples = decode["samples"]
    # From the second sample on: the first is taken at the first token, before
    # the decode loop's own first allocations.
    body = samples[1:] if len(samples) > 2 else samples
    xs = [s["tokens"] for s in body]
    rss_slope = linear_slope(xs, [s["rss"] for s in body])
    active_slope = linear_slope(xs, [s["active"] for s in body])
    buffers = [s["active"] + max(s.get("cache", 0), 0) for s in body]
    buffers_slope = linear_slope(xs, buffers)
    outside_slope = linear_slope(xs, [s["rss"] - b for s, b in zip(body, buffers)])
    first, last = samples[0], samples[-1]
    t = [s["t"] for s in samples]
    n = [s["tokens"] for s in samples]
    half = len(samples) // 2
    rate = lambda a, b: (n[b] - n[a]) / (t[b] - t[a]) if t[b] > t[a] else None  # noqa: E731
    return {
        "rss_start_mb": first["rss"] / MB,
        "rss_end_mb": last["rss"] / MB,
        "rss_delta_mb": (last["rss"] - first["rss"]) / MB,
        "rss_per_10k_mb": rss_slope * 10_000 / MB if rss_slope is not None else None,
        "active_per_10k_mb": active_slope * 10_000 / MB if active_slope is not None else None,
        # MLX buffers = active + the freed buffers MLX keeps for reuse (KV cache growth
        # lands here); outside = the rest of RSS, where lazy graph nodes live.
        "buffers_per_10k_mb": buffers_slope * 10_000 / MB if buffers_slope is not None else None,
        "outside_per_10k_mb": outside_slope * 10_000 / MB if outside_slope is not None else None,
        "tok_s": decode["decoded"] / decode["decode_s"] if decode.get("decode_s") else None,
        "tok_s_first_half": rate(0, half),
        "tok_s_second_half": rate(half, len(samples) - 1),
        "stale_eval_s": decode["stale_eval_s"],
        "stale_fields": decode["stale_fields"],
        "rss_after_eval_mb": decode["rss_after_eval"] / MB,
    }


def main() -> int:
    def arguments(parser):
        parser.add_argument("--layers", type=int, default=None,
                            help="qwen3_next layers, full attention every 4th "
                                 "[default: 48 (36 linear); --quick: 12 (9 linear)]")
        parser.add_argument("--tokens", type=int, default=None,
                            help="tokens to decode per variant [default: 3000; --quick: 400]")
        parser.add_argument("--versions", default=MAIN_VERSION,
                            help="comma list of venvs for the decode [default: %(default)s]; "
                                 "the micro table always runs in all of them")

    fig = Figure("memory_growth", "Figure 5: memory growth per 10k decode tokens, hybrid model",
                 __doc__, add_arguments=arguments)
    layers = fig.args.layers or (12 if fig.quick else 48)
    tokens = fig.args.tokens or (400 if fig.quick else 3000)
    sample_every = max(10, tokens // 30)
    micro = "1000,10000" if fig.quick else "1000,10000,100000"
    versions = [v.strip() for v in fig.args.versions.split(",") if v.strip()]
    linear = layers - layers // 4
    work = temp_dir("bench-memory-")
    fig.log(f"building qwen3_next: {layers} layers ({linear} linear)")
    model = build_model("qwen3_next", work / "qwen3_next", layers=layers,
                        full_attention_interval=4)
    results = {"layers": layers, "linear_layers": linear, "tokens": tokens,
               "sample_every": sample_every, "micro_n": micro, "decode": {}, "micro": {}}
    rows, micro_rows, summary = [], [], {}
    for version in VERSIONS:
        decode_here = version in versions
        for variant in VARIANTS:
            what = f"{tokens} tokens + micro" if decode_here else "micro only"
            fig.log(f"{version} {variant}: {what}")
            data = run_probe(fig, version, variant, model, tokens if decode_here else 0,
                             sample_every, micro, work)
            results["micro"][f"{version}-{variant}"] = data["micro"]
            if not decode_here:
                continue
            g = growth(data["decode"])
            results["decode"][f"{version}-{variant}"] = {"probe": data, "growth": g}
            fig.log(f"  {variant}: RSS {g['rss_start_mb']:.0f} -> {g['rss_end_mb']:.0f} MB, "
                    f"{fmt(g['rss_per_10k_mb'], ' MB')}/10k tokens, {fmt(g['tok_s'], ' tok/s', 1)}, "
                    f"stale eval {g['stale_eval_s'] * 1000:.1f} ms")
            rows.append([version, variant, data["decode"]["decoded"],
                         f"{g['rss_start_mb']:.0f} → {g['rss_end_mb']:.0f} MB",
                         f"{fmt(g['rss_per_10k_mb'], ' MB', 1)}",
                         fmt(g["buffers_per_10k_mb"], " MB", 1),
                         f"**{fmt(g['outside_per_10k_mb'], ' MB', 1)}**",
                         f"{g['stale_eval_s'] * 1000:.1f} ms ({g['stale_fields']} arrays)",
                         f"{fmt(g['tok_s'], '', 1)} ({fmt(g['tok_s_first_half'], '', 1)} → "
                         f"{fmt(g['tok_s_second_half'], '', 1)})"])
            summary[f"{version}-{variant}"] = {"rss_per_10k_mb": g["rss_per_10k_mb"],
                                               "outside_mlx_buffers_per_10k_mb":
                                                   g["outside_per_10k_mb"],
                                               "stale_eval_ms": g["stale_eval_s"] * 1000,
                                               "tok_s": g["tok_s"]}
        stock_m = {m["n"]: m for m in results["micro"][f"{version}-stock"]}
        patched_m = {m["n"]: m for m in results["micro"][f"{version}-patched"]}
        for n in sorted(stock_m):
            s, p = stock_m[n], patched_m[n]
            micro_rows.append([version, f"{n:,}", f"{s['eval_s'] * 1000:.2f} ms",
                               f"{p['eval_s'] * 1000:.2f} ms", f"{s['rss_growth'] / MB:.0f} MB",
                               f"{p['rss_growth'] / MB:.0f} MB",
                               "yes" if s["values"] == p["values"] else "**no**"])
    body = (f"**Decode through BatchGenerator**: tiny qwen3_next, {layers} layers ({linear} "
            f"linear-attention layers with an ArraysCache), one prompt, greedy\n\n")
    body += table(["mlx-lm", "advance", "tokens", "RSS", "RSS growth per 10k tokens",
                   "… in MLX buffers (KV cache, allocator cache)",
                   "… outside MLX buffers (lazy graph nodes)",
                   "eval of the stale metadata at the end",
                   "tok/s (first half → second half)"], rows)
    body += ("\n\n**`advance(1)` N times on one ArraysCache, then one `mx.eval` of "
             "`lengths` and `left_padding`** (no model)\n\n")
    body += table(["mlx-lm", "N", "eval, stock", "eval, patched", "RSS added, stock",
                   "RSS added, patched", "same values"], micro_rows)
    body += (f"\n\nRSS is sampled every {sample_every} tokens from /proc/self/statm inside the "
             "decoding process, with `mx.get_active_memory()` and `mx.get_cache_memory()`; each "
             "growth is the least-squares slope over the decode, scaled to 10,000 tokens "
             f"({tokens} were decoded; the stale graph grows linearly, one lazy node per step per "
             "linear layer). Both variants grow the same KV cache (the full-attention layers) and "
             "MLX's cache of freed buffers: that is the 'in MLX buffers' column, and it moves in "
             "steps. The stale graph is not a buffer: it is the 'outside' column. The "
             "stale-metadata time is reading every live ArraysCache's `lengths`/`left_padding` "
             "and one `mx.eval` of them all, just before the sequence ends. RSS added by the "
             "micro loop can read 0 MB when the allocator reuses freed heap.")
    fig.write(results, body, summary)
    return 0


if __name__ == "__main__":
    run_main(main)
