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
