"""Figure 10: a non-streaming client that hangs up, with the `disconnect` part
and without it (stock behaviour: MLX_HOTFIX_DISABLE=disconnect).

Real stock servers, tiny random llama, CPU, one decode slot
(--decode-concurrency 1 --prompt-concurrency 1; stock's completion batch is
the larger of the two). Client A asks for 4000 tokens and hangs up after
0.5 s; client B then asks for 1 token. Measured, per release, side by side
in one run: B's wait, and the decode steps spent (GenerationBatch.next calls,
counted by harness/faults) by the time B is served. Stamped with the
git revision.
"""

from __future__ import annotations

import json
import socket
import time


from bench.common import FAULTS_DIR, SHIM_DIR, VERSIONS, Figure, build_model, run_main, table, temp_dir
from harness.server import StockServer

ONE_SLOT = ["--decode-concurrency", "1", "--prompt-concurrency", "1"]
LONG = 4000


def _one(version, model, work, shim_part_on):
    count = work / f"steps-{version}-{shim_part_on}"
    env = {"PYTHONPATH": f"{SHIM_DIR}:{FAULTS_DIR}", "MLX_TEST_DECODE_COUNT_FILE": str(count)}
    if not shim_part_on:
        env["MLX_HOTFIX_DISABLE"] = "disconnect"
    server = StockServer(version, model, work, env=env, args=ONE_SLOT).start()

    def steps():
        try:
            return int(count.read_text())
        except (OSError, ValueError):
            return 0

    try:
        server.warm_up()
        base = steps()
        body = json.dumps({"model": "default_model", "max_tokens": LONG, "temperature": 0.0,
                           "messages": [{"role": "user", "content": "a long story"}]}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                           b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                           % len(body) + body)
            time.sleep(0.5)
        started = time.monotonic()
        b = server.chat("b", max_tokens=1, timeout=600)
        wait = time.monotonic() - started
        return {"b_status": b.status_code, "b_wait_s": round(wait, 3),
                "decode_steps_by_b": steps() - base}
    finally:
        server.stop()


def main() -> int:
    figure = Figure("disconnect_savings",
                    "Figure 10: a client that hangs up, decode steps and queue wait saved",
                    __doc__)
    work = temp_dir("disconnect-")
    model = build_model("llama", work / "model")
    results, rows = {}, []
    for version in VERSIONS:
        stock = _one(version, model, work, False)
        ours = _one(version, model, work, True)
        results[version] = {"stock": stock, "shim": ours}
        figure.log(f"{version}: stock {stock}, shim {ours}")
        rows.append([version, f"{stock['b_wait_s']:.2f} s", f"{ours['b_wait_s']:.2f} s",
                     f"{stock['b_wait_s'] - ours['b_wait_s']:.2f} s",
                     stock["decode_steps_by_b"], ours["decode_steps_by_b"],
                     stock["decode_steps_by_b"] - ours["decode_steps_by_b"]])
    body = ("Client A: 4000 tokens, hangs up after 0.5 s; client B: 1 token; one decode "
            "slot.\n\n" + table(
                ["mlx-lm", "B waits (stock)", "B waits (shim)", "queue wait removed",
                 "decode steps (stock)", "decode steps (shim)", "decode steps saved"], rows))
    figure.write(results, body)
    return 0


if __name__ == "__main__":
    run_main(main)
