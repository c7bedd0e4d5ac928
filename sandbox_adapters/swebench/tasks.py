"""Generator of small SWE-bench-style tasks: Python repositories with one bug each, in the SWE-bench 5 schema.

Each task is a git repository at ``base_commit`` (a package with a bug and tests that still pass) plus an instance
with every field the SWE-bench 5 harness reads: ``instance_id, repo, version, base_commit, problem_statement,
hints_text, created_at, environment_setup_commit, patch`` (the gold fix), ``test_patch`` (new tests that expose the
bug), ``FAIL_TO_PASS``/``PASS_TO_PASS`` (JSON strings, as in the published datasets), ``eval_script`` (the usual
reset-tests / apply-test-patch / markers / ``pytest -rA`` script, run at ``/testbed``), ``log_parser``
(``parse_log_pytest``), ``eval_type`` and ``image`` (unused locally), plus our ``bug_kind``.
``swebench.harness.utils.load_swebench_dataset`` loads the written ``instances.jsonl`` as is.

Bug kinds: off-by-one, wrong comparison operator, missing edge case, wrong default, swapped arguments, missing
normalisation. Task ``i`` uses kind ``i % 6`` with constants drawn from ``random.Random(seed + i)``, so the output
is identical for the same arguments (commits use a fixed author and date).

Command line: ``python -m sandbox_adapters.swebench.tasks OUT_DIR [--num N] [--seed S]`` writes
``OUT_DIR/instances.jsonl``
and ``OUT_DIR/repos/<instance_id>/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
from collections.abc import Callable
from typing import Any

__all__ = ["BUG_KINDS", "generate_tasks", "load_tasks"]

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "bpo-tasks",
    "GIT_AUTHOR_EMAIL": "tasks@bpo.invalid",
    "GIT_COMMITTER_NAME": "bpo-tasks",
    "GIT_COMMITTER_EMAIL": "tasks@bpo.invalid",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
}


@dataclasses.dataclass(frozen=True)
class _Bug:
    """One generated bug: module source before/after the fix, the tests, and the issue text."""

    module: str
    buggy: str
    fixed: str
    old_tests: str  # pass before and after the fix (PASS_TO_PASS)
    new_tests: str  # fail before, pass after (FAIL_TO_PASS)
    issue: str


def _off_by_one(rng: random.Random) -> _Bug:
    k = rng.randint(2, 4)
    body = "    return [sum(values[i : i + size]) for i in range(len(values) - size{end})]\n"
    src = 'def window_sums(values, size):\n    """Sums of every contiguous window of ``size`` values."""\n' + body
    xs = [rng.randint(1, 9) for _ in range(k + 3)]
    last = sum(xs[-k:])
    return _Bug(
        module="windows",
        buggy=src.format(end=""),
        fixed=src.format(end=" + 1"),
        old_tests=f"def test_window_sums_first():\n    assert window_sums({xs}, {k})[0] == {sum(xs[:k])}\n",
        new_tests=(f"def test_window_sums_count():\n    assert len(window_sums({xs}, {k})) == {len(xs) - k + 1}\n\n\n"
                   f"def test_window_sums_last():\n    assert window_sums({xs}, {k})[-1] == {last}\n"),
        issue=(f"`window_sums(values, size)` drops the last window. For `values={xs}` and `size={k}` it returns "
               f"{len(xs) - k} sums, but there are {len(xs) - k + 1} windows; the last one ({last}) is missing."),
    )


def _wrong_operator(rng: random.Random) -> _Bug:
    limit = rng.choice([16, 18, 21])
    src = (f"ADULT_AGE = {limit}\n\n\ndef is_adult(age):\n"
           f'    """True when ``age`` is at least ``ADULT_AGE``."""\n    return age {{op}} ADULT_AGE\n')
    return _Bug(
        module="ages",
        buggy=src.format(op=">"),
        fixed=src.format(op=">="),
        old_tests=(f"def test_older_is_adult():\n    assert is_adult({limit + 5})\n\n\n"
                   f"def test_younger_is_not_adult():\n    assert not is_adult({limit - 3})\n"),
        new_tests=f"def test_exact_age_is_adult():\n    assert is_adult({limit})\n",
        issue=f"`is_adult({limit})` returns False, but someone who is exactly {limit} is an adult (see the docstring).",
    )


def _missing_edge_case(rng: random.Random) -> _Bug:
    fallback = rng.choice(["0.0", "None"])
    head = f'def mean(values):\n    """Arithmetic mean; an empty sequence has mean ``{fallback}``."""\n'
    fixed_guard = f"    if not values:\n        return {fallback}\n"
    tail = "    return sum(values) / len(values)\n"
    xs = [rng.randint(1, 9) for _ in range(4)]
    return _Bug(
        module="stats",
        buggy=head + tail,
        fixed=head + fixed_guard + tail,
        old_tests=f"def test_mean():\n    assert mean({xs}) == {sum(xs) / len(xs)!r}\n",
        new_tests=f"def test_mean_of_nothing():\n    assert mean([]) == {fallback}\n" if fallback != "None"
        else "def test_mean_of_nothing():\n    assert mean([]) is None\n",
        issue=f"`mean([])` raises ZeroDivisionError; the docstring promises `{fallback}` for an empty sequence.",
    )


def _wrong_default(rng: random.Random) -> _Bug:
    size = rng.choice([5, 10, 20])
    src = ("def paginate(items, page=0, page_size={size}):\n"
           f'    """Items of page ``page`` (pages hold {size} items unless ``page_size`` says otherwise)."""\n'
           "    start = page * page_size\n    return items[start : start + page_size]\n")
    return _Bug(
        module="pages",
        buggy=src.format(size=size * 10),
        fixed=src.format(size=size),
        old_tests="def test_explicit_page_size():\n    assert paginate(list(range(10)), 1, 3) == [3, 4, 5]\n",
        new_tests=(f"def test_default_page_size():\n    assert len(paginate(list(range(1000)))) == {size}\n\n\n"
                   f"def test_second_page():\n    assert paginate(list(range(1000)), 1)[0] == {size}\n"),
        issue=f"`paginate(items)` returns {size * 10} items per page; the documented default page size is {size}.",
    )


def _swapped_arguments(rng: random.Random) -> _Bug:
    a, b = rng.randint(20, 90), rng.choice([2, 4, 5])
    src = ('def ratio(part, whole):\n    """``part`` divided by ``whole``; 0.0 when ``whole`` is 0."""\n'
           "    if {guard} == 0:\n        return 0.0\n    return {num} / {den}\n")
    return _Bug(
        module="ratios",
        buggy=src.format(guard="part", num="whole", den="part"),
        fixed=src.format(guard="whole", num="part", den="whole"),
        old_tests=f"def test_equal_parts():\n    assert ratio({a}, {a}) == 1.0\n",
        new_tests=(f"def test_ratio():\n    assert ratio({b}, {b * 4}) == 0.25\n\n\n"
                   f"def test_zero_whole():\n    assert ratio({b}, 0) == 0.0\n"),
        issue=f"`ratio({b}, {b * 4})` returns 4.0 instead of 0.25, and `ratio({b}, 0)` raises ZeroDivisionError.",
    )


def _missing_normalisation(rng: random.Random) -> _Bug:
    sep = rng.choice(["-", "_"])
    head = f'def slugify(title):\n    """Lower-case words of ``title`` joined by ``{sep!s}``."""\n'
    return _Bug(
        module="slugs",
        buggy=head + f"    return {sep!r}.join(title.split())\n",
        fixed=head + f"    return {sep!r}.join(title.lower().split())\n",
        old_tests=f"def test_slugify_words():\n    assert slugify('a  b c') == {f'a{sep}b{sep}c'!r}\n",
        new_tests=f"def test_slugify_lowercases():\n    assert slugify('Hello World') == {f'hello{sep}world'!r}\n",
        issue=f"`slugify('Hello World')` returns {f'Hello{sep}World'!r}; slugs must be lower case.",
    )


#: kind name -> bug builder; task i uses the (i % len)-th kind.
BUG_KINDS: dict[str, Callable[[random.Random], _Bug]] = {
    "off_by_one": _off_by_one,
    "wrong_operator": _wrong_operator,
    "missing_edge_case": _missing_edge_case,
    "wrong_default": _wrong_default,
    "swapped_arguments": _swapped_arguments,
    "missing_normalisation": _missing_normalisation,
}

_EVAL_SCRIPT = """#!/bin/bash
set -uxo pipefail
cd /testbed
git status
git -c core.fileMode=false diff {base}
git checkout {base} -- {test_file}
git apply -v - <<'EOF_114329324912'
{test_patch}
EOF_114329324912
: '>>>>> Start Test Output'
python -m pytest -rA -p no:cacheprovider {test_file}
: '>>>>> End Test Output'
git checkout {base} -- {test_file}
"""


def _git(repo: str, *args: str) -> str:
    env = {**os.environ, **_GIT_ENV}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _test_names(tests: str, test_file: str) -> list[str]:
    return [f"{test_file}::{line[4:].split('(')[0]}" for line in tests.splitlines() if line.startswith("def test_")]


def _make_task(out_dir: str, index: int, kind: str, seed: int) -> dict[str, Any]:
    bug = BUG_KINDS[kind](random.Random(seed + index))
    instance_id = f"bpo-local__{kind}-{index}"
    package = f"pkg{index}"
    repo = os.path.join(out_dir, "repos", instance_id)
    module_file, test_file = f"{package}/{bug.module}.py", f"tests/test_{bug.module}.py"
    imports = f"from {package}.{bug.module} import *  # noqa: F403\n\n\n"
    _write(os.path.join(repo, module_file), bug.buggy)
    _write(os.path.join(repo, package, "__init__.py"), "")
    _write(os.path.join(repo, "tests", "__init__.py"), "")
    _write(os.path.join(repo, test_file), imports + bug.old_tests)
    _write(os.path.join(repo, ".gitignore"), "__pycache__/\n*.pyc\n.pytest_cache/\n")
    _write(os.path.join(repo, "README.md"), f"# {package}\n\nSmall utilities ({bug.module}). Run `pytest`.\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "Initial version")
    base_commit = _git(repo, "rev-parse", "HEAD").strip()
    # the gold and test patches are diffs against base_commit; the repository itself stays at base_commit
    _write(os.path.join(repo, module_file), bug.fixed)
    patch = _git(repo, "diff", "--no-color")
    _git(repo, "checkout", "-q", "--", module_file)
    _write(os.path.join(repo, test_file), imports + bug.old_tests + "\n\n" + bug.new_tests)
    test_patch = _git(repo, "diff", "--no-color")
    _git(repo, "checkout", "-q", "--", test_file)
    return {
        "instance_id": instance_id,
        "repo": f"bpo-local/{package}",
        "version": "0.1",
        "base_commit": base_commit,
        "environment_setup_commit": base_commit,
        "created_at": "2024-01-01T00:00:00Z",
        "problem_statement": bug.issue,
        "hints_text": "",
        "patch": patch,
        "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(_test_names(bug.new_tests, test_file)),
        "PASS_TO_PASS": json.dumps(_test_names(bug.old_tests, test_file)),
        "eval_script": _EVAL_SCRIPT.format(base=base_commit, test_file=test_file, test_patch=test_patch.rstrip("\n")),
        "log_parser": "parse_log_pytest",
        "eval_type": "pass_and_fail",
        "image": "local",
        "bug_kind": kind,
    }


def generate_tasks(out_dir: str, num: int = 6, seed: int = 0) -> list[dict[str, Any]]:
    """Write ``num`` tasks under ``out_dir`` (``instances.jsonl`` + ``repos/``) and return their instances."""
    os.makedirs(out_dir, exist_ok=True)
    kinds = list(BUG_KINDS)
    instances = [_make_task(out_dir, i, kinds[i % len(kinds)], seed) for i in range(num)]
    with open(os.path.join(out_dir, "instances.jsonl"), "w") as f:
        for instance in instances:
            f.write(json.dumps(instance, sort_keys=True) + "\n")
    return instances


def load_tasks(dataset_path: str, repos_dir: str | None = None) -> list[dict[str, Any]]:
    """Instances of a local ``.json``/``.jsonl`` (read by SWE-bench's own loader) with ``repo_path`` filled in.

    ``repo_path`` = ``repos_dir/<instance_id>``; ``repos_dir`` defaults to ``repos/`` next to the dataset file.
    """
    from swebench.harness.utils import load_swebench_dataset

    repos_dir = repos_dir or os.path.join(os.path.dirname(os.path.abspath(dataset_path)), "repos")
    return [{**inst, "repo_path": os.path.join(repos_dir, inst["instance_id"])}
            for inst in load_swebench_dataset(dataset_path)]


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--num", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    generate_tasks(args.out_dir, args.num, args.seed)


if __name__ == "__main__":
    _main()
