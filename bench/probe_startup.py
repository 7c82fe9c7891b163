"""Start-up cost of `mlx-watchdog probe`, lazy CLI vs the eager one it replaced.

    <python> -m bench.probe_startup [--quick] [--runs N] [--results-dir DIR]

Both arms run in the same run, interleaved, against a closed port (so the
probe itself costs nothing and only start-up is measured):
- lazy: `python -m mlx_watchdog probe` as it is now;
- eager: the same, after importing every command module first, which is what
  the CLI did before (prometheus_client, installer, daemon modules).
Writes probe_startup.json and .md, stamped with the git revision.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import MAIN_VERSION, ROOT, noise_verdict, percentile, stamp, stamp_line

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=None, help="paired runs [default: 15; 8 with --quick]")
    parser.add_argument("--quick", action="store_true", help="fewer runs (bench/run_all's default)")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    if args.runs is None:
        args.runs = 8 if args.quick else 15
    once(LAZY), once(EAGER)  # warm the file cache
    lazy, eager = [], []
    for _ in range(args.runs):
        lazy.append(once(LAZY))
        eager.append(once(EAGER))
    figure_stamp = stamp("bench.probe_startup", sys.argv[1:], versions=(MAIN_VERSION,))
    # The noise: the larger interquartile range of the two arms. A difference
    # of medians inside it is no result.
    noise = max(percentile(lazy, 75) - percentile(lazy, 25),
                percentile(eager, 75) - percentile(eager, 25))
    difference = statistics.median(eager) - statistics.median(lazy)
    result = {
        **figure_stamp, "runs": args.runs, "python": sys.version.split()[0],
        "noise_s": noise,
        "verdict": noise_verdict(difference, noise, f"lazy is {difference * 1000:.0f} ms faster"),
        "lazy_median_s": statistics.median(lazy), "eager_median_s": statistics.median(eager),
        "ratio_lazy_to_eager": statistics.median(lazy) / statistics.median(eager),
        "lazy_s": lazy, "eager_s": eager,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "probe_startup.json").write_text(
        json.dumps(result, indent=1, default=str) + "\n")
    md = (
        "## `mlx-watchdog probe` start-up\n\n"
        "| CLI | median wall time (s) | ratio |\n|---|---|---|\n"
        f"| eager (every command module imported, as before) | {result['eager_median_s']:.3f} | 1.00 |\n"
        f"| lazy (now) | {result['lazy_median_s']:.3f} | {result['ratio_lazy_to_eager']:.2f} |\n\n"
        f"Verdict: {result['verdict']} (noise: the larger interquartile range, "
        f"{noise * 1000:.0f} ms).\n\n"
        f"_{args.runs} interleaved runs each, probe to a closed port; "
        f"{stamp_line(figure_stamp)}._\n"
    )
    (args.results_dir / "probe_startup.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
