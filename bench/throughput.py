"""Figure 4: decode throughput with the shim, divided by stock's.

For each tested release and each tiny model -- a llama (2 layers) and a
hybrid qwen3_next (3 gated-delta linear layers + 1 full-attention layer, MoE)
-- two real servers run side by side from the same venv: stock (no
PYTHONPATH) and shim (PYTHONPATH=sitecustomize; exit, advance and, on
0.31.3, extend patches applied). Both idle between requests. Then, in
ABBA blocks (stock, shim, shim, stock; then shim, stock, stock, shim) so
that drift on a busy machine cancels, each gets one long greedy completion
(non-streaming, a fixed short prompt, max_tokens=L):

    tokens/s = usage.completion_tokens / wall time of the request
    server CPU per token = the server process's user + system CPU time over
                           the request / usage.completion_tokens

Reported per model and release: the median tokens/s of each arm, the ratio
of the medians (shim / stock), and the median and range of the per-pair
ratios (each shim run against the stock run next to it), and the server's
CPU time per token of each arm with the median paired difference (CPU time
moves less than wall time on a busy machine). Goal: >= 0.99.

On qwen3_next, stock's ArraysCache.advance chains one lazy node per step
behind each linear layer's lengths/left_padding (upstream #1641): the
patched advance does not, so long decodes can be faster with the shim.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil

from bench.common import (
    VERSIONS,
    Figure,
    build_model,
    fmt,
    run_main,
    stats,
    table,
    temp_dir,
)
from bench.procs import TimedServer
from harness.procs import chat

GOAL = 0.99
PROMPT = "Write a very long story about a fox and a dog."
ABBA = (("stock", "shim", "shim", "stock"), ("shim", "stock", "stock", "shim"))


def cpu_seconds(server: TimedServer) -> float:
    """User + system CPU time of the server process, all its threads."""
    times = psutil.Process(server.proc.pid).cpu_times()
    return times.user + times.system


def one_run(server: TimedServer, max_tokens: int) -> dict:
    cpu0 = cpu_seconds(server)
    t0 = time.perf_counter()
    response = chat(server.url, PROMPT, max_tokens=max_tokens, timeout=1800)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(server) - cpu0
    response.raise_for_status()
    usage = response.json()["usage"]
    tokens = usage["completion_tokens"]
    return {"tokens": tokens, "prompt_tokens": usage.get("prompt_tokens"), "wall_s": wall,
            "tok_s": tokens / wall, "cpu_s": cpu, "cpu_us_per_token": cpu / tokens * 1e6}


def measure(fig: Figure, version: str, model_name: str, model: Path, work: Path,
            blocks: int, max_tokens: int) -> dict:
    servers = {
        "stock": TimedServer(version, model, work, shim=False),
        "shim": TimedServer(version, model, work, shim=True),
    }
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_listening(180)
            one_run(s, 32)  # load, compile, first allocations
        hotfix = [t for _, t in servers["shim"].out.lines if t.startswith("mlx-hotfix: mlx-lm")]
        runs = {"stock": [], "shim": []}
        pairs, cpu_pairs = [], []
        for b in range(blocks):
            order = ABBA[b % 2]
            block, seen = {}, []
            for position, arm in enumerate(order):
                run = one_run(servers[arm], max_tokens)
                run["block"], run["position"] = b, position
                runs[arm].append(run)
                block.setdefault(arm, []).append(run)
                seen.append(f"{arm} {run['tok_s']:.0f}")
            # Adjacent runs pair up: A1 with B1, and B2 with A2 (the k-th of each arm).
            pairs += [sh["tok_s"] / st["tok_s"] for sh, st in zip(block["shim"], block["stock"])]
            cpu_pairs += [sh["cpu_us_per_token"] - st["cpu_us_per_token"]
                          for sh, st in zip(block["shim"], block["stock"])]
            fig.log(f"  {model_name} {version} block {b + 1}/{blocks}: "
                    + ", ".join(seen) + " tok/s")
        for arm, s in servers.items():
            assert s.alive(), f"{arm} server died:\n{s.log()[-2000:]}"
        st = {arm: stats(r["tok_s"] for r in runs[arm]) for arm in runs}
        return {
            "hotfix_line": hotfix[0] if hotfix else None,
            "max_tokens": max_tokens,
            "runs": runs,
            "stats_tok_s": st,
            "ratio_of_medians": st["shim"]["median"] / st["stock"]["median"],
            "pair_ratios": pairs,
            "pair_ratio_stats": stats(pairs),
            "stats_cpu_us_per_token": {arm: stats(r["cpu_us_per_token"] for r in runs[arm])
                                       for arm in runs},
            "cpu_pair_differences_us": cpu_pairs,
            "cpu_pair_difference_stats": stats(cpu_pairs),
        }
    finally:
        for s in servers.values():
            s.stop()


def main() -> int:
    def arguments(parser):
        parser.add_argument("--blocks", type=int, default=None,
                            help="ABBA blocks per model and release [default: 4; --quick: 1]")
        parser.add_argument("--max-tokens", type=int, default=None,
                            help="tokens per completion [default: 2000; --quick: 300]")

    fig = Figure("throughput", "Figure 4: decode throughput, shim / stock", __doc__,
                 add_arguments=arguments)
    blocks = fig.args.blocks or (1 if fig.quick else 4)
    max_tokens = fig.args.max_tokens or (300 if fig.quick else 2000)
    work = temp_dir("bench-throughput-")
    models = {
        "llama": build_model("llama", work / "llama"),
        "qwen3_next": build_model("qwen3_next", work / "qwen3_next"),
    }
    results = {"blocks": blocks, "max_tokens": max_tokens, "goal": GOAL, "prompt": PROMPT,
               "models": {"llama": "tiny llama: 2 layers, hidden 64",
                          "qwen3_next": "tiny qwen3_next: 4 layers (3 linear + 1 full), "
                                        "hidden 64, 4 experts"},
               "measurements": {}}
    rows, summary = [], {}
    for model_name, model in models.items():
        for version in VERSIONS:
            fig.log(f"{model_name} on mlx-lm {version}: {blocks} ABBA blocks of {max_tokens} tokens")
            m = measure(fig, version, model_name, model, work, blocks, max_tokens)
            key = f"{model_name}-{version}"
            results["measurements"][key] = m
            st, pr = m["stats_tok_s"], m["pair_ratio_stats"]
            cpu, cd = m["stats_cpu_us_per_token"], m["cpu_pair_difference_stats"]
            ratio = m["ratio_of_medians"]
            rows.append([f"tiny {model_name}", version, f"{st['stock']['n']} + {st['shim']['n']}",
                         fmt(st["stock"]["median"], "", 1), fmt(st["shim"]["median"], "", 1),
                         f"**{ratio:.3f}**", f"{pr['median']:.3f}",
                         f"{pr['min']:.3f} – {pr['max']:.3f}",
                         "yes" if ratio >= GOAL else "**no**",
                         f"{fmt(cpu['stock']['median'], '', 0)} / {fmt(cpu['shim']['median'], '', 0)}",
                         f"{cd['median']:+.0f} ({cd['min']:+.0f} – {cd['max']:+.0f})"])
            summary[key] = {"ratio_of_medians": ratio, "median_pair_ratio": pr["median"],
                            "meets_goal": ratio >= GOAL,
                            "cpu_us_per_token_difference_median": cd["median"]}
    body = table(["model", "mlx-lm", "runs (stock + shim)", "stock tok/s (median)",
                  "shim tok/s (median)", "shim / stock", "median pair ratio", "pair ratio range",
                  f"≥ {GOAL}", "server CPU µs per token, stock / shim (medians)",
                  "shim − stock, µs per token (median of pairs, range)"], rows)
    body += (f"\n\nOne greedy completion of {max_tokens} tokens per run, non-streaming, through "
             "the real `mlx_lm.server` (`--model` a tiny random model, CPU); tokens/s = "
             "`usage.completion_tokens` / wall time of the request. A stock and a shimmed server "
             f"run side by side; {blocks} ABBA block(s) alternate them so drift cancels. The "
             "hybrid qwen3_next has 3 linear-attention layers, where stock's `ArraysCache.advance` "
             "grows a lazy graph every step and the shim's does not. Server CPU: user + system "
             "time of the server process (all threads) over the request, per completion token; "
             "less sensitive to a busy machine than wall time, counted in clock ticks (10 ms on "
             f"Linux: {10e3 / max_tokens:.0f} µs per token at {max_tokens} tokens). The shim's "
             "own work per token, wrapper by wrapper: figure 8.")
    fig.write(results, body, summary)
    return 0


if __name__ == "__main__":
    run_main(main)
