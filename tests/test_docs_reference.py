"""docs/reference.md stays true: every shim setting, CLI command and flag,
watch config key, metric and alert is listed there, and every name listed
there still exists in the code.

Each failure says what to add (or remove) and where in docs/reference.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import yaml

from mlx_watchdog import config, contract
from mlx_watchdog.cli import main
from mlx_watchdog.metrics import Metrics

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "reference.md"
TEXT = REFERENCE.read_text()


def _section(title: str) -> str:
    """The text of the `## title` section (up to the next `## `)."""
    match = re.search(r"^## %s\n(.*?)(?=^## |\Z)" % re.escape(title), TEXT, re.S | re.M)
    assert match, f"docs/reference.md has no '## {title}' section"
    return match.group(1)


def _first_column(text: str) -> "set[str]":
    """Every `name` in the first cell of the table rows in text."""
    names = set()
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            first = line.split(" | ")[0]
            names.update(re.findall(r"`([^`]+)`", first))
    return names


def _missing(what: str, where: str, names: "set[str]", row: str) -> str:
    return (f"docs/reference.md, section '{where}': add a row for each {what}:\n"
            + "\n".join(row.format(name=n) for n in sorted(names)))


def _stale(what: str, where: str, names: "set[str]") -> str:
    return (f"docs/reference.md, section '{where}' lists {what} that no longer exist; "
            f"remove (or rename) them: {', '.join(sorted(names))}")


# -- environment ---------------------------------------------------------------

_SHIM_NAME = re.compile(r"MLX_HOTFIX(?:_[A-Z][A-Z_]*[A-Z])?")


def _shim_settings() -> "set[str]":
    """Every MLX_HOTFIX* name in the shim's code (config.py reads the settings;
    sitecustomize.py reads MLX_HOTFIX; contract.py names what the watchdog sets)."""
    names = set()
    for path in (REPO / "sitecustomize").rglob("*.py"):
        names.update(_SHIM_NAME.findall(path.read_text()))
    return names


def test_every_shim_setting_is_in_the_reference_and_every_listed_one_exists():
    section = _section("Environment variables")
    shim_part = section.split("### The watchdog")[0]
    listed = {n for n in _first_column(shim_part) if n.startswith("MLX_HOTFIX")}
    code = _shim_settings()
    assert not code - listed, _missing(
        "shim setting", "Environment variables / The shim", code - listed,
        "| `{name}` | DEFAULT | what it does |")
    assert not listed - code, _stale("shim settings", "Environment variables", listed - code)


def test_every_watchdog_variable_listed_exists():
    section = _section("Environment variables").split("### The watchdog")[1]
    source = "".join(p.read_text() for p in (REPO / "watchdog").rglob("*.py"))
    listed = {n for n in _first_column(section) if n.startswith("MLX_WATCHDOG")}
    used = set(re.findall(r"MLX_WATCHDOG_[A-Z_]*[A-Z]", source))
    assert not used - listed, _missing("watchdog variable", "Environment variables / The watchdog",
                                       used - listed, "| `{name}` | what it does |")
    assert not listed - used, _stale("watchdog variables", "Environment variables", listed - used)


# -- the command line --------------------------------------------------------------


def _commands():
    """(path, command) for every command, walking the lazy click tree."""
    def walk(command, path, ctx):
        yield path, command
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                yield from walk(sub, f"{path} {name}", click.Context(sub, info_name=name,
                                                                       parent=ctx))

    yield from walk(main, "mlx-watchdog", click.Context(main, info_name="mlx-watchdog"))


def _flags(command) -> "set[str]":
    return {flag for param in command.params
            if isinstance(param, click.Option) and not param.hidden
            for flag in param.opts + param.secondary_opts if flag.startswith("--")}


def _documented_commands() -> "dict[str, set[str]]":
    section = _section("Command line")
    out = {}
    for match in re.finditer(r"^### `([^`]+)`\n(.*?)(?=^### |\Z)", section, re.S | re.M):
        out[match.group(1)] = {n for n in _first_column(match.group(2)) if n.startswith("--")}
    return out


def test_every_command_and_flag_is_in_the_reference():
    documented = _documented_commands()
    problems = []
    for path, command in _commands():
        if path not in documented:
            problems.append(f"add a section '### `{path}`' (its first help line, then a "
                            f"'| flag | meaning |' table) under '## Command line'")
            continue
        for flag in sorted(_flags(command) - documented[path]):
            problems.append(f"under '### `{path}`' add the row: | `{flag}` | what it does |")
    assert not problems, "docs/reference.md:\n" + "\n".join(problems)


def test_every_documented_command_and_flag_exists():
    real = {path: _flags(command) | {"--help"} for path, command in _commands()}
    problems = []
    for path, flags in _documented_commands().items():
        if path not in real:
            problems.append(f"'### `{path}`' is no command: remove it")
            continue
        problems += [f"'### `{path}`' lists {flag}, which it does not take: remove the row"
                     for flag in sorted(flags - real[path])]
    assert not problems, "docs/reference.md:\n" + "\n".join(problems)


# -- the watch config ------------------------------------------------------------------


def test_every_watch_config_key_is_in_the_reference():
    section = _section("The watch config (TOML)")
    parts = re.split(r"^### ", section, flags=re.M)
    top = _first_column(next(p for p in parts if p.startswith("Top-level keys")))
    per_instance = _first_column(next(p for p in parts if p.startswith("`[instances.NAME]`")))
    restart = next(p for p in parts if p.startswith("`restart = "))
    code_top, code_instance = set(config._GLOBAL), set(config._INSTANCE) | set(config.RETIRED)
    assert not code_top - top, _missing("top-level key", "The watch config / Top-level keys",
                                        code_top - top, "| `{name}` | DEFAULT | meaning |")
    assert not top - code_top, _stale("top-level keys", "The watch config", top - code_top)
    assert not code_instance - per_instance, _missing(
        "instance key", "The watch config / [instances.NAME]", code_instance - per_instance,
        "| `{name}` | DEFAULT | meaning |")
    assert not per_instance - code_instance, _stale(
        "instance keys", "The watch config", per_instance - code_instance)
    rows = {m.group(1): set(re.findall(r"`([a-z_]+)`", m.group(2)))
            for m in re.finditer(r"^\| `([a-z]+)` \| (.*) \|$", restart, re.M)}
    for kind, keys in config._RESTART.items():
        assert kind in rows, f"docs/reference.md, restart types: add | `{kind}` | KEYS |"
        assert set(keys) == rows[kind] - {"none"}, (
            f"docs/reference.md, restart type `{kind}`: its keys are {sorted(keys)}")


# -- metrics and alerts ----------------------------------------------------------------


def _exported_metrics() -> "dict[str, tuple]":
    """name as scraped (a counter with _total) -> its labels."""
    metrics = Metrics()
    out = {}
    for collector in metrics.registry._collector_to_names:
        suffix = "_total" if collector._type == "counter" else ""
        out[collector._name + suffix] = tuple(collector._labelnames)
    return out


def test_every_metric_and_its_labels_are_in_the_reference():
    section = _section("Metrics")
    rows = {m.group(1): tuple(re.findall(r"`([a-z_]+)`", m.group(2)))
            for m in re.finditer(r"^\| `(mlx_watchdog_[a-z_]+)` \| [a-z]+ \| ([^|]*) \|", section,
                                 re.M)}
    exported = _exported_metrics()
    missing = {n for n in exported if n not in rows}
    assert not missing, _missing("metric", "Metrics", missing,
                                 "| `{name}` | TYPE | `instance`, ... | meaning |")
    assert not set(rows) - set(exported), _stale("metrics", "Metrics", set(rows) - set(exported))
    for name, labels in exported.items():
        assert rows[name] == labels, (
            f"docs/reference.md, Metrics: `{name}`'s labels are {', '.join(labels)}")
    for cause in contract.RESTART_CAUSES:
        assert f"`{cause}`" in section, (
            f"docs/reference.md, Metrics: add `{cause}` to the restart causes (the reason label)")


def test_every_alert_is_in_the_reference():
    rules = yaml.safe_load((REPO / "monitoring" / "alerts.yml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    listed = _first_column(_section("Alerts"))
    assert not alerts - listed, _missing("alert", "Alerts", alerts - listed,
                                         "| `{name}` | SEVERITY | FOR | its summary |")
    assert not listed - alerts, _stale("alerts", "Alerts", listed - alerts)


# -- report fields, exit codes, the README's link ------------------------------------


def test_the_report_fields_of_both_writers_are_in_the_reference(tmp_path):
    from mlx_watchdog import reports

    path = reports.capture_stacks([], reason="test", directory=tmp_path, wait_s=0,
                                  extra={"stacks_refused": "x", "command": ["x"]})
    written = set(reports.load_reports(tmp_path)[0]) - {"id"}
    listed = _first_column(_section("Crash report fields"))
    shim = set(re.findall(r'"([a-z_]+)": ', (REPO / "sitecustomize" / "mlx_hotfix" /
                                               "reports.py").read_text()))
    shim |= set(re.findall(r'_gather\("([a-z_]+)"', (REPO / "sitecustomize" / "mlx_hotfix" /
                                                    "reports.py").read_text()))
    shim -= {"thread", "ident", "stack", "type", "message", "message_redacted", "traceback",
             "name", "port", "model", "mlx_lm", "mlx", "python", "os"}  # nested fields
    assert path is not None
    missing = (written | shim) - listed
    assert not missing, _missing("report field", "Crash report fields", missing,
                                 "| `{name}` | shim/watchdog | meaning |")


def test_the_exit_codes_are_the_contracts():
    section = _section("Exit codes")
    assert f"`{contract.EXIT_CODE}`" in section


def test_the_readme_links_the_reference():
    assert "docs/reference.md" in (REPO / "README.md").read_text()
