"""`python -m mlx_watchdog` is `mlx-watchdog`."""

from mlx_watchdog.cli import main

main()
