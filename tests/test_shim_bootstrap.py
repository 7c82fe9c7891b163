"""The drop-in's bootstrap: cost, kill switch, chaining, gates, status line.

Everything runs in subprocesses of the tested releases' venvs: pytest itself
replaces threading.excepthook, and a sitecustomize only runs at start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from harness.server import ROOT, SHIM_DIR, VERSIONS, base_env, python_for, run_python

SNAPSHOT = (
    "import sys, json; print(json.dumps({'modules': sorted(sys.modules), "
    "'meta_path': [type(f).__name__ if not isinstance(f, type) else f.__name__ "
    "for f in sys.meta_path]}))"
)


def snapshot(version, *, shim, env=None, pythonpath=None):
    extra = dict(env or {})
    if pythonpath is not None:
        extra["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    result = run_python(version, SNAPSHOT, shim=shim, env=extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def test_unrelated_python_imports_nothing_but_the_bootstrap(envs):
    without, _ = snapshot("0.32.2", shim=False)
    with_shim, stderr = snapshot("0.32.2", shim=True)
    assert stderr == ""
    assert set(with_shim["modules"]) - set(without["modules"]) == {"sitecustomize"}
    assert with_shim["meta_path"][0] == "_MlxLmImportTrigger"
    assert not any(m.startswith(("mlx", "threading")) for m in with_shim["modules"]
                   if m not in without["modules"] and m != "sitecustomize")


def test_kill_switch_leaves_the_interpreter_untouched(envs):
    without, _ = snapshot("0.32.2", shim=False)
    inert, stderr = snapshot("0.32.2", shim=True, env={"MLX_HOTFIX": "0"})
    assert stderr == ""
    assert inert == without


def test_kill_switch_after_importing_mlx_lm(envs):
    code = "import mlx_lm.server, sys; print(sorted(m for m in sys.modules if 'hotfix' in m))"
    result = run_python("0.31.3", code, env={"MLX_HOTFIX": "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert "mlx-hotfix" not in result.stderr


@pytest.fixture
def user_site(tmp_path):
    folder = tmp_path / "user-site"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(textwrap.dedent("""
        import os, sys
        with open(os.environ["USER_SITE_LOG"], "a") as log:
            log.write("ran\\n")
        if os.environ.get("USER_SITE_RAISES"):
            raise ValueError("boom from the user's sitecustomize")
        if os.environ.get("USER_SITE_EXITS"):
            sys.exit(int(os.environ["USER_SITE_EXITS"]))
        USER_MARK = True
    """))
    return folder


@pytest.mark.parametrize("switch", ["1", "0"])
def test_user_sitecustomize_runs_exactly_once(envs, tmp_path, user_site, switch):
    log = tmp_path / "runs.log"
    copy = tmp_path / "second-copy-of-dropin"
    # A second copy of the drop-in on the path must not make it run twice.
    subprocess.run(["cp", "-r", str(SHIM_DIR), str(copy)], check=True)
    code = "import sitecustomize as s; print(s.__file__)"
    result = run_python(
        "0.32.2", code,
        env={"PYTHONPATH": os.pathsep.join([str(SHIM_DIR), str(copy), str(user_site)]),
             "USER_SITE_LOG": str(log), "MLX_HOTFIX": switch},
    )
    assert result.returncode == 0, result.stderr
    assert log.read_text() == "ran\n"
    expected = user_site if switch == "0" else SHIM_DIR
    assert Path(result.stdout.strip()).parent == expected


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_raising_user_sitecustomize_is_reported_and_start_goes_on(envs, tmp_path, user_site,
                                                                   switch):
    log = tmp_path / "runs.log"
    result = run_python(
        "0.32.2", "print('started')",
        env={"PYTHONPATH": os.pathsep.join([str(SHIM_DIR), str(user_site)]),
             "USER_SITE_LOG": str(log), "USER_SITE_RAISES": "1", "MLX_HOTFIX": switch},
    )
    assert result.returncode == 0
    assert result.stdout.strip() == "started"
    assert log.read_text() == "ran\n"
    assert "ValueError: boom from the user's sitecustomize" in result.stderr
    assert result.stderr.count("boom") == 1


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_user_sitecustomize_that_exits_still_exits(envs, tmp_path, user_site, switch):
    # site.py lets SystemExit out of a sitecustomize (Python then refuses to
    # start); with the drop-in chaining that file, the same must happen.
    def started(paths, log):
        return run_python(
            "0.32.2", "print('started')", shim=False,
            env={"PYTHONPATH": os.pathsep.join(map(str, paths)), "USER_SITE_LOG": str(log),
                 "USER_SITE_EXITS": "3", "MLX_HOTFIX": switch},
        )

    stock = started([user_site], tmp_path / "stock.log")
    chained = started([SHIM_DIR, user_site], tmp_path / "chained.log")
    assert (tmp_path / "chained.log").read_text() == "ran\n"
    assert stock.returncode != 0 and "started" not in stock.stdout
    assert chained.returncode == stock.returncode, chained.stderr
    assert "started" not in chained.stdout
    assert "SystemExit: 3" in chained.stderr


_NEW_PARTS = ("; recover off (MLX_HOTFIX_RECOVER=exit: a death exits 70); disconnect applied; "
              "prompt_cache_bytes applied; extract applied; "
              "admission applied (max queue off, queue timeout off, request timeout off)")
EXPECTED_STATUS = {
    "0.31.3": ("mlx-lm 0.31.3, mlx 0.32.4; exit applied; heartbeat applied; extend applied; "
               "advance applied" + _NEW_PARTS),
    "0.32.2": ("mlx-lm 0.32.2, mlx 0.32.4; exit applied; heartbeat applied; extend skipped: "
               "PromptProcessingBatch.extend no longer pads logits processors with None "
               "(fixed upstream in 0.32.0); advance applied" + _NEW_PARTS),
}


@pytest.mark.parametrize("version", VERSIONS)
def test_one_status_line_when_the_server_module_loads(envs, version):
    result = run_python(version, "import mlx_lm.server")
    assert result.returncode == 0, result.stderr
    lines = [l for l in result.stderr.splitlines() if l.startswith("mlx-hotfix:")]
    assert lines == ["mlx-hotfix: " + EXPECTED_STATUS[version]]


def test_no_status_line_for_mlx_lm_outside_the_server(envs):
    result = run_python("0.31.3", "import mlx_lm.generate")
    assert result.returncode == 0, result.stderr
    assert "mlx-hotfix" not in result.stderr


def test_disable_list_and_unknown_names(envs):
    result = run_python("0.31.3", "import mlx_lm.server",
                        env={"MLX_HOTFIX_DISABLE": "exit, advance,bogus"})
    assert result.returncode == 0, result.stderr
    lines = [l for l in result.stderr.splitlines() if l.startswith("mlx-hotfix:")]
    assert lines == [
        "mlx-hotfix: MLX_HOTFIX_DISABLE: unknown name 'bogus' ignored; "
        "known names: exit, heartbeat, extend, advance, recover, disconnect, prompt_cache_bytes, "
        "extract, admission",
        "mlx-hotfix: mlx-lm 0.31.3, mlx 0.32.4; exit disabled; heartbeat applied; extend applied; "
        "advance disabled" + _NEW_PARTS,
    ]


def test_bad_numbers_are_named_and_defaults_used(envs):
    result = run_python("0.31.3", "import mlx_lm.server",
                        env={"MLX_HOTFIX_EXIT_CODE": "0", "MLX_HOTFIX_EXIT_GRACE": "soon",
                             "MLX_HOTFIX_STALL_TIMEOUT": "0"})
    assert result.returncode == 0, result.stderr
    assert "MLX_HOTFIX_EXIT_CODE='0' is not an integer from 1 to 255; using 70" in result.stderr
    assert ("MLX_HOTFIX_STALL_TIMEOUT='0' is not a number of seconds from 1 to 86400; "
            "using 300.0") in result.stderr
    assert "MLX_HOTFIX_EXIT_GRACE='soon' is not a number of seconds" in result.stderr


def test_a_target_that_does_not_fit_is_skipped_and_the_server_still_loads(envs, tmp_path):
    # A user sitecustomize (chained by the shim) reshapes the target before the
    # shim sees it, as a future mlx-lm release might.
    folder = tmp_path / "reshaper"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(textwrap.dedent("""
        import mlx_hotfix
        def reshape(cache):
            def advance(self, N):
                pass  # some other implementation
            cache.ArraysCache.advance = advance
        mlx_hotfix.when_imported("mlx_lm.models.cache", reshape)
        def drop(server):
            del server.APIHandler.handle_health_check
        mlx_hotfix.when_imported("mlx_lm.server", drop)
    """))
    result = run_python("0.31.3", "import mlx_lm.server; print('loaded')",
                        env={"PYTHONPATH": os.pathsep.join([str(SHIM_DIR), str(folder)])})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "loaded"
    lines = [l for l in result.stderr.splitlines() if l.startswith("mlx-hotfix:")]
    assert len(lines) == 1, lines
    parts = lines[0].split("; ")
    assert "exit skipped: APIHandler.handle_health_check is missing" in parts
    assert "extend applied" in parts
    assert "advance skipped: ArraysCache.advance is no longer the lazy '-=' (fixed upstream?)" in parts
    assert "heartbeat skipped: APIHandler.handle_health_check is missing" in parts


def test_hooks_fire_once_and_restore_the_loader(envs):
    code = textwrap.dedent("""
        import importlib, mlx_lm.server as s, mlx_lm.models.cache as c
        import mlx_hotfix
        calls = []
        mlx_hotfix.when_imported("mlx_lm.server", lambda m: calls.append(m.__name__))
        importlib.import_module("mlx_lm.server")
        print(type(s.__loader__).__name__, type(s.__spec__.loader).__name__,
              type(c.__loader__).__name__, calls)
    """)
    result = run_python("0.31.3", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["SourceFileLoader", "SourceFileLoader",
                                     "SourceFileLoader", "['mlx_lm.server']"]


def test_the_module_body_runs_with_the_real_loader(envs, tmp_path):
    # The wrapper is for the import machinery only: the module's own code
    # (importlib.resources, pkgutil, a reload) must see the real loader.
    (tmp_path / "watched.py").write_text(
        "SEEN = (type(__loader__).__name__, type(__spec__.loader).__name__)\n")
    code = textwrap.dedent("""
        import mlx_hotfix
        from mlx_hotfix import _hooks
        _hooks.install()
        calls = []
        mlx_hotfix.when_imported("watched", lambda m: calls.append(m.SEEN))
        import watched, importlib
        importlib.reload(watched)
        import watched
        print(watched.SEEN, type(watched.__loader__).__name__, calls)
    """)
    result = run_python("0.32.2", code,
                        env={"PYTHONPATH": os.pathsep.join([str(SHIM_DIR), str(tmp_path)])})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "('SourceFileLoader', 'SourceFileLoader') SourceFileLoader "
        "[('SourceFileLoader', 'SourceFileLoader')]")


def test_shim_path_of_a_pip_installed_copy_works_the_same_way(envs, tmp_path):
    target = tmp_path / "site"
    main_python = str(python_for("0.32.2"))
    build = subprocess.run(
        [main_python, "-m", "pip", "install", "--quiet", "--no-deps",
         "--target", str(target), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr
    env = base_env(shim=False, extra={"PYTHONPATH": str(target)})
    shown = subprocess.run([main_python, "-c",
                            "from mlx_watchdog.cli import main; main()", "shim-path"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    folder = Path(shown.stdout.strip())
    assert folder == target / "mlx_watchdog" / "dropin"
    assert (folder / "sitecustomize.py").is_file()
    used = run_python("0.31.3", "import mlx_lm.server",
                      env={"PYTHONPATH": str(folder)})
    assert used.returncode == 0, used.stderr
    assert "mlx-hotfix: " + EXPECTED_STATUS["0.31.3"] in used.stderr
