"""Figure 12: start-up cost of `mlx-watchdog probe`, lazy CLI vs the eager one it replaced.

    <main python> -m bench.probe_startup [--quick] [--runs N] [--results-dir DIR]

Both arms run in the same run, interleaved, against a closed port (so the
probe itself costs nothing and only start-up is measured):
- lazy: `python -m mlx_watchdog probe` as it is now;
- eager: the same, after importing every command module first, which is what
  the CLI did before (prometheus_client, installer, daemon modules).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from bench.common import Figure, noise_verdict, percentile, run_main, table

PROBE = ["probe", "--url", "http://127.0.0.1:9", "--timeout", "1"]
EAGER = ("import sys, mlx_watchdog.daemon_cli, mlx_watchdog.install.cli, "
         "mlx_watchdog.reports_cli; from mlx_watchdog.cli import main; "
         "sys.argv = ['mlx-watchdog'] + sys.argv[1:]; main()")
LAZY = ("import sys; from mlx_watchdog.cli import main; "
        "sys.argv = ['mlx-watchdog'] + sys.argv[1:]; main()")


def once(code: str) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, *PROBE], capture_output=True, timeout=60)
    return time.perf_counter() - began


def main() -> int:
    fig = Figure("probe_startup", "Figure 12: `mlx-watchdog probe` start-up", __doc__,
                 add_arguments=lambda p: p.add_argument(
                     "--runs", type=int, default=None,
                     help="paired runs [default: 15; 8 with --quick]"))
    runs = fig.args.runs or (8 if fig.quick else 15)
    once(LAZY), once(EAGER)  # warm the file cache
    lazy, eager = [], []
    for _ in range(runs):
        lazy.append(once(LAZY))
        eager.append(once(EAGER))
    # The noise: the larger interquartile range of the two arms. A difference
    # of medians inside it is no result.
    noise = max(percentile(lazy, 75) - percentile(lazy, 25),
                percentile(eager, 75) - percentile(eager, 25))
    difference = statistics.median(eager) - statistics.median(lazy)
    verdict = noise_verdict(difference, noise, f"lazy is {difference * 1000:.0f} ms faster")
    lazy_s, eager_s = statistics.median(lazy), statistics.median(eager)
    results = {"runs": runs, "python": sys.version.split()[0], "noise_s": noise,
               "verdict": verdict, "lazy_median_s": lazy_s, "eager_median_s": eager_s,
               "ratio_lazy_to_eager": lazy_s / eager_s, "lazy_s": lazy, "eager_s": eager}
    body = table(["CLI", "median wall time (s)", "ratio"], [
        ["eager (every command module imported, as before)", f"{eager_s:.3f}", "1.00"],
        ["lazy (now)", f"{lazy_s:.3f}", f"{lazy_s / eager_s:.2f}"]])
    body += (f"\n\nVerdict: {verdict} (noise: the larger interquartile range, "
             f"{noise * 1000:.0f} ms). {runs} interleaved runs each, probe to a closed port.")
    fig.write(results, body, {"verdict": verdict, "ratio_lazy_to_eager": lazy_s / eager_s})
    return 0


if __name__ == "__main__":
    run_main(main)
