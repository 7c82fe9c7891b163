"""Figure: a burst of clients on one slot, with the `admission` part
(MLX_HOTFIX_MAX_QUEUE=2) and without it (stock: MLX_HOTFIX_DISABLE=admission).

Real stock servers, tiny random llama, CPU, one slot (--decode-concurrency 1
--prompt-concurrency 1: stock's batch is the larger of the two). N clients
arrive at once (every connection opened first, then every request written in
one loop: harness/storm.py), each asking for 200 tokens. Measured per
release, stock and admission bursts alternating (ABAB) in one run: the p50
and p99 latency of the requests that were served (from the request written
to the whole answer read), and how long a refused client waited for its 503
(its time to the first, and only, answer). With stock nobody is refused and
the last client waits for all the others; with admission three are served
(one running, two waiting) and the rest learn at once that the server is
busy, with a Retry-After. Stamped with the git revision.
"""

from __future__ import annotations

from bench.common import (FAULTS_DIR, SHIM_DIR, VERSIONS, Figure, build_model, percentile,
                          run_main, table, temp_dir)
from bench.procs import TimedServer
from harness.storm import burst

ONE_SLOT = ["--decode-concurrency", "1", "--prompt-concurrency", "1"]
TOKENS = 200
MAX_QUEUE = 2
CONFIGS = ("stock", "admission")


def _server(version, model, work, config):
    env = {"PYTHONPATH": f"{SHIM_DIR}:{FAULTS_DIR}"}
    if config == "stock":
        env["MLX_HOTFIX_DISABLE"] = "admission"
    else:
        env["MLX_HOTFIX_MAX_QUEUE"] = str(MAX_QUEUE)
    server = TimedServer(version, model, work, env=env, args=ONE_SLOT).start()
    server.warm_up()
    return server


def _summary(rounds):
    served = [a["latency_s"] for r in rounds for a in r if a["status"] == 200]
    refused = [a["latency_s"] for r in rounds for a in r if a["status"] == 503]
    other = [a for r in rounds for a in r if a["status"] not in (200, 503)]
    out = {"served": len(served), "refused": len(refused), "other": len(other)}
    for name, values in (("served", served), ("refused", refused)):
        for p in (50, 99):
            out[f"{name}_p{p}_s"] = round(percentile(values, p), 3) if values else None
        out[f"{name}_max_s"] = round(max(values), 3) if values else None
    return out


def main() -> int:
    figure = Figure("admission_burst", "A burst on one slot: admission (bounded queue) vs stock",
                    __doc__)
    clients = 20
    repeats = 2 if figure.quick else 5
    work = temp_dir("admission-")
    model = build_model("llama", work / "model")
    revision = figure.stamp["revision"]
    results, rows = {"git_revision": revision, "clients": clients, "tokens": TOKENS,
                     "max_queue": MAX_QUEUE, "repeats": repeats}, []
    summary = {}
    for version in VERSIONS:
        servers = {config: _server(version, model, work, config) for config in CONFIGS}
        rounds = {config: [] for config in CONFIGS}
        try:
            for repeat in range(repeats):
                for config in CONFIGS:  # ABAB: both under the same minutes' load
                    answers = burst(servers[config].port, clients, max_tokens=TOKENS)
                    rounds[config].append([{"status": a.status, "latency_s": a.latency_s,
                                            "retry_after": a.headers.get("retry-after")}
                                           for a in answers])
                    figure.log(f"{version} {config} burst {repeat + 1}/{repeats}: "
                               f"{_summary(rounds[config][-1:])}")
        finally:
            for server in servers.values():
                server.stop()
        results[version] = {config: {"summary": _summary(rounds[config]),
                                     "rounds": rounds[config]} for config in CONFIGS}
        stock, ours = (results[version][c]["summary"] for c in CONFIGS)
        summary[version] = {
            "stock_served_p99_s": stock["served_p99_s"],
            "admission_served_p99_s": ours["served_p99_s"],
            "admission_refused_p99_s": ours["refused_p99_s"],
            "served_p99_ratio": (round(ours["served_p99_s"] / stock["served_p99_s"], 3)
                                 if ours["served_p99_s"] and stock["served_p99_s"] else None),
        }
        for config, data in ((c, results[version][c]["summary"]) for c in CONFIGS):
            rows.append([version, config, f"{data['served']}/{data['refused']}",
                         _s(data["served_p50_s"]), _s(data["served_p99_s"]),
                         _s(data["refused_p50_s"]), _s(data["refused_p99_s"])])
    body = (f"{clients} clients at once, {TOKENS} tokens each, one slot; admission with "
            f"`MLX_HOTFIX_MAX_QUEUE={MAX_QUEUE}`; {repeats} bursts per configuration, "
            f"alternating. Git revision {revision}.\n\n"
            + table(["mlx-lm", "server", "served/refused", "served p50", "served p99",
                     "refused: 503 after (p50)", "refused: 503 after (p99)"], rows)
            + "\n\nServed latency: from the request written to the whole answer read. "
              "A refused client's only answer is its 503 (with Retry-After); with stock "
              "every client is served and the p99 is the wait for everyone ahead.")
    figure.write(results, body, summary)
    return 0


def _s(value):
    return "-" if value is None else f"{value:.2f} s"


if __name__ == "__main__":
    run_main(main)
