"""The benchmark figures (see bench/README.md). Run each from the repository root:

    <main python> -m bench.<figure> [--quick] [--results-dir DIR]

or all of them with ``bench/run_all``. Run as modules, they import the shared
``harness`` package and ``bench.common`` without any path set-up.
"""
