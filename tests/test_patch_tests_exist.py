"""Every patch names the test that reproduces its bug on stock and proves the fix.

The TEST constant of each registered patch (sitecustomize/mlx_hotfix/patches)
must name a test file that exists, so the pointer cannot go stale.
"""

import json
import subprocess
import sys

from harness import ROOT, SHIM_DIR

LIST_TESTS = (
    "import json, mlx_hotfix.patches as p, sys; "
    "print(json.dumps({m.NAME: getattr(m, 'TEST', None) for m in p.PATCHES})); "
    "print('mlx_lm' in sys.modules)"
)


def test_every_patch_names_an_existing_test_file():
    # In a subprocess: importing the shim into pytest would leave it loaded.
    result = subprocess.run([sys.executable, "-c", LIST_TESTS], capture_output=True, text=True,
                            env={"PYTHONPATH": str(SHIM_DIR), "MLX_HOTFIX": "0"}, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    tests = json.loads(lines[0])
    assert lines[1] == "False"  # listing the registry imports no mlx_lm
    assert set(tests) >= {"exit", "heartbeat", "extend", "advance", "recover", "disconnect",
                          "prompt_cache_bytes", "extract", "admission"}
    missing = {name: test for name, test in tests.items()
               if not test or not (ROOT / test).is_file() or not test.startswith("tests/test_")}
    assert not missing, f"patches whose TEST names no test file: {missing}"


LIST_KINDS = (
    "import json, mlx_hotfix.patches as p; "
    "print(json.dumps({m.NAME: [getattr(m, 'KIND', None), m.__file__] for m in p.PATCHES}))"
)


def test_every_patch_declares_its_kind_and_a_fix_proves_its_target():
    """KIND (patches/__init__.py): a "fix" changes what stock code computes, so
    it applies only where its check finds the buggy code verbatim
    (_source.source_of); a "fail-safe" may apply wherever its hook points exist."""
    result = subprocess.run([sys.executable, "-c", LIST_KINDS], capture_output=True, text=True,
                            env={"PYTHONPATH": str(SHIM_DIR), "MLX_HOTFIX": "0"}, timeout=60)
    assert result.returncode == 0, result.stderr
    kinds = json.loads(result.stdout)
    bad = {name: kind for name, (kind, _) in kinds.items() if kind not in ("fix", "fail-safe")}
    assert not bad, f'patches whose KIND is not "fix" or "fail-safe": {bad}'
    unproved = [name for name, (kind, path) in kinds.items()
                if kind == "fix" and "source_of" not in open(path).read()]
    assert not unproved, f"fix parts that never check the stock source (source_of): {unproved}"
