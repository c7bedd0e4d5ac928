"""The README's summary table shows what the recorded runs measured, and nothing else.

A row whose source cell cites ``docs/results/<name>.json`` names the result keys it shows in backticks (a nested
value by its dotted path, ``walk.gradient.bpo_over_rloo``); each key's value (rounded to 2 decimals) must appear in the
row's "measured" cell. The files are written by
``benchmarks/record.py`` from a benchmark's last line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CITE = re.compile(r"docs/results/([\w.-]+)\.json")


def summary_rows(readme: str) -> list[list[str]]:
    """The cells of the table under "## Does it help, and what does it cost?"."""
    section = readme.split("## Does it help, and what does it cost?", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header[:2] == ["what", "measured"] and header[-1] == "source", header
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))] for row in rows[2:]]


def cited(rows: list[list[str]]) -> list[tuple[str, str, list[str], str]]:
    """(row label, file name, keys, measured cell) for every row that cites a recorded run."""
    out = []
    for cells in rows:
        match = CITE.search(cells[-1])
        if match:
            keys = [k for k in re.findall(r"`([^`]+)`", cells[-1]) if not CITE.search(k) and not k.endswith(".py")]
            out.append((cells[0], match.group(1), keys, cells[1]))
    return out


def figure(value) -> str:
    return f"{value:.2f}"


def lookup(result: dict, key: str):
    """``result[key]``, or the value at a dotted path of nested keys; ``KeyError`` when there is none."""
    if key in result:
        return result[key]
    value = result
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def check(readme: str, results: Path) -> None:
    for label, name, keys, measured in cited(summary_rows(readme)):
        path = results / f"{name}.json"
        assert path.exists(), f"README row {label!r} cites {path}, which does not exist"
        entry = json.loads(path.read_text())
        for field in ("command", "date", "wall_s", "result"):
            assert field in entry, f"{path} lacks {field!r} (write it with benchmarks/record.py)"
        assert keys, f"README row {label!r} cites {path.name} but names no result key"
        for key in keys:
            try:
                value = lookup(entry["result"], key)
            except KeyError:
                raise AssertionError(f"README row {label!r}: {path.name} has no key {key!r}") from None
            assert figure(value) in measured, (
                f"README row {label!r} shows {measured!r}, but {path.name}'s {key} is {value}")


def test_the_readme_figures_are_the_recorded_ones():
    readme = (ROOT / "README.md").read_text()
    assert cited(summary_rows(readme)), "the README's summary cites no recorded run"
    check(readme, ROOT / "docs" / "results")


def test_a_figure_that_differs_from_its_record_is_caught(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps(
        {"command": "python b.py", "date": "2026-01-01", "wall_s": 1.0,
         "result": {"ratio": 0.3049, "walk": {"ratio": 1.8}}}))
    table = ("## Does it help, and what does it cost?\n\n| what | measured | target | met | source |\n"
             "|---|---|---|---|---|\n| x | {} | ≤ 0.4 | yes | docs/results/run.json `ratio` |\n\n## Next\n")
    check(table.format("0.30×"), tmp_path)
    with pytest.raises(AssertionError, match="ratio is 0.3049"):
        check(table.format("0.31×"), tmp_path)
    with pytest.raises(AssertionError, match="no key"):
        check(table.format("0.30×").replace("`ratio`", "`ratio2`"), tmp_path)
    check(table.format("1.80×").replace("`ratio`", "`walk.ratio`"), tmp_path)
    with pytest.raises(AssertionError, match="walk.ratio is 1.8"):
        check(table.format("0.30×").replace("`ratio`", "`walk.ratio`"), tmp_path)
    with pytest.raises(AssertionError, match="no key"):
        check(table.format("1.80×").replace("`ratio`", "`walk.nothing`"), tmp_path)
