"""The committed benchmark figures describe one revision, and every figure is there.

bench/run_all lists every figure (one line each in FIGURES=( ... )) and writes
bench/results/RESULTS.md with a ``<!-- figure: NAME -->`` line before each
figure's fragment. These checks read the committed files only (cheap, no
server): a figure measured on another revision than RESULTS.md says, or on a
tree with uncommitted changes, a registered figure with no fragment, or a
fragment of no registered figure fails CI; so does a figure script that
run_all does not run. Regenerate with `bench/run_all --full` on a clean tree.
"""

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
RUN_ALL = BENCH / "run_all"
MARKER = re.compile(r"^<!-- figure: (\S+) -->$", re.M)
REVISION = re.compile(r"\bgit ([0-9a-f]{7,40})\b")


def registered():
    """The names in run_all's FIGURES=( ... ) list, in order."""
    text = RUN_ALL.read_text()
    block = re.search(r"^FIGURES=\(\n(.*?)^\)", text, re.M | re.S)
    assert block, "bench/run_all has no FIGURES=( ... ) list, one figure per line"
    names = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    return [n for n in names if n]


def fragments(results=RESULTS):
    """{name: text} of every figure fragment in RESULTS.md."""
    text = (results / "RESULTS.md").read_text()
    found = list(MARKER.finditer(text))
    out = {}
    for i, m in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else text.find("\n| figure | status")
        out[m.group(1)] = text[m.end():end if end > 0 else len(text)]
    return out


def problems(names, results=RESULTS):
    """What is wrong with the results folder for the registered figures names."""
    text = (results / "RESULTS.md").read_text()
    m = re.search(r"^Run of .* on git ([0-9a-f]{7,40})( \(uncommitted changes\))?", text, re.M)
    if not m:
        return ["RESULTS.md does not say which revision it ran on"]
    revision = m.group(1)
    out = []
    if m.group(2):
        out.append("RESULTS.md was measured on a tree with uncommitted changes")
    found = fragments(results)
    for name in names:
        if name not in found:
            out.append(f"no fragment for {name}")
    for name, fragment in found.items():
        if name not in names:
            out.append(f"a fragment for {name}, which bench/run_all does not list")
            continue
        if "_Not measured:" in fragment:
            out.append(f"{name} was not measured")
            continue
        seen = set(REVISION.findall(fragment))
        if seen != {revision}:
            out.append(f"{name} says git {', '.join(sorted(seen)) or '(none)'}, "
                       f"RESULTS.md git {revision}")
        if "(uncommitted changes)" in fragment:
            out.append(f"{name} was measured with uncommitted changes")
        try:
            document = json.loads((results / f"{name}.json").read_text())
        except (OSError, ValueError) as exc:
            out.append(f"{name}.json: {exc}")
            continue
        if document.get("revision") != revision or document.get("dirty") is not False:
            out.append(f"{name}.json says revision {document.get('revision')} "
                       f"(dirty: {document.get('dirty')}), RESULTS.md git {revision}")
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text):
        if not (results / link).is_file():
            out.append(f"RESULTS.md links {link}, which is not there")
    return out


def test_every_figure_script_is_registered_and_exists():
    names = registered()
    assert len(names) == len(set(names)), f"a figure is listed twice in bench/run_all: {names}"
    for name in names:
        assert (BENCH / f"{name}.py").is_file(), f"bench/run_all lists {name}, but bench/{name}.py is missing"
    scripts = {p.stem for p in BENCH.glob("*.py") if "Figure(" in p.read_text()} - {"common"}
    assert scripts - set(names) == set(), (
        f"figure scripts that bench/run_all does not run: {sorted(scripts - set(names))}; "
        "add one line each to FIGURES in bench/run_all")


def test_the_committed_figures_are_all_there_and_of_one_clean_revision():
    found = problems(registered())
    assert not found, ("bench/results does not describe one revision: " + "; ".join(found)
                       + ". Regenerate on a clean tree with bench/run_all --full.")


def _results(folder, revision="abc1234", figures=("one", "two"), **changes):
    """A results folder as run_all writes it; changes: {name: (md revision, json revision,
    dirty)} per figure, "header": the header's revision text, "extra": another fragment."""
    folder.mkdir(exist_ok=True)
    lines = ["# Benchmark results", "",
             f"Run of `bench/run_all --full` on git {changes.get('header', revision)}, "
             "started x, took 1 min 0 s.", ""]
    for name in list(figures) + ([changes["extra"]] if "extra" in changes else []):
        md_rev, json_rev, dirty = changes.get(name, (revision, revision, False))
        lines += [f"<!-- figure: {name} -->", f"### Figure: {name}", "",
                  f"_Full mode, 1 s; git {md_rev}{' (uncommitted changes)' if dirty else ''}, "
                  "2026-12-01. Machine: m. Command: `c`._", ""]
        (folder / f"{name}.json").write_text(json.dumps(
            {"figure": name, "revision": json_rev, "dirty": dirty}))
    lines += ["| figure | status | seconds |", "|---|---|---|"]
    (folder / "RESULTS.md").write_text("\n".join(lines) + "\n")
    return folder


def test_the_check_passes_one_clean_revision_and_names_each_problem(tmp_path):
    names = ["one", "two"]
    assert problems(names, _results(tmp_path / "good")) == []
    assert problems(names, _results(tmp_path / "a", figures=["one"])) == ["no fragment for two"]
    assert problems(names, _results(tmp_path / "b", extra="three")) == [
        "a fragment for three, which bench/run_all does not list"]
    assert problems(names, _results(tmp_path / "c", two=("def5678", "def5678", False))) == [
        "two says git def5678, RESULTS.md git abc1234",
        "two.json says revision def5678 (dirty: False), RESULTS.md git abc1234"]
    assert problems(names, _results(tmp_path / "d", one=("abc1234", "abc1234", True))) == [
        "one was measured with uncommitted changes",
        "one.json says revision abc1234 (dirty: True), RESULTS.md git abc1234"]
    assert problems(names, _results(tmp_path / "e", header="abc1234 (uncommitted changes)")) == [
        "RESULTS.md was measured on a tree with uncommitted changes"]


@pytest.fixture
def repo_copy(tmp_path):
    """A git repository holding only bench/run_all, committed."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "run_all").write_bytes(RUN_ALL.read_bytes())
    (tmp_path / "bench" / "run_all").chmod(0o755)
    for name in registered():
        (tmp_path / "bench" / f"{name}.py").write_text("")
    (tmp_path / "tracked.txt").write_text("one\n")

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return tmp_path


def test_run_all_refuses_a_dirty_tree_unless_told(repo_copy):
    (repo_copy / "tracked.txt").write_text("two\n")
    refused = subprocess.run(["bash", str(repo_copy / "bench" / "run_all")], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2
    assert "uncommitted changes" in refused.stderr and "--allow-dirty" in refused.stderr
    assert "tracked.txt" in refused.stderr
    # Told: it goes on (here to setting up the envs, which this copy does not have).
    told = subprocess.run(["bash", str(repo_copy / "bench" / "run_all"), "--allow-dirty"],
                          capture_output=True, text=True, timeout=60)
    assert "uncommitted changes" not in told.stderr
    assert "setup-envs" in told.stderr


def test_the_plots_draw_a_timeline_and_link_it(tmp_path):
    from bench import plots

    requests = [[t - 0.2, t, t < 0 or t > 3] for t in [x / 4 for x in range(-16, 40)]]
    (tmp_path / "demo.json").write_text(json.dumps({"figure": "demo", "results": {"timelines": {
        "death 0.32.2": {"title": "a death", "zero": "death", "arms": {
            "stock": {"requests": [r for r in requests if r[1] < 0], "events": []},
            "ours": {"requests": requests, "events": [[3.0, "serving again"]]}}}}}}))
    links = plots.draw_all(tmp_path / "demo.json")
    assert links == ["![a death](demo.death-0.32.2.png)"]
    assert (tmp_path / "demo.death-0.32.2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plots.rate([[0, 0.1, True], [0, 0.2, False], [0, 0.7, True]], 0, 1) == (
        [0.0, 0.5], [2.0, 2.0])
