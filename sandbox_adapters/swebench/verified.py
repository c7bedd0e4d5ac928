"""Classic SWE-bench rows (SWE-bench Verified as published) completed to the SWE-bench 5 schema the grader reads.

SWE-bench Verified is published with 13 fields per row: ``repo, instance_id, base_commit, patch, test_patch,
problem_statement, hints_text, created_at, version, FAIL_TO_PASS, PASS_TO_PASS, environment_setup_commit,
difficulty``. ``swebench`` 5's ``make_test_spec`` also needs ``eval_script``, ``log_parser``, ``eval_type`` and
``image``, which rows of the SWE-bench 5 schema carry and classic rows do not. :func:`complete_instance` derives
them the way the SWE-bench harness did when it still derived them from the row (``swebench`` 4.x,
``make_eval_script_list_py``):

* ``eval_script``: activate the image's conda env ``testbed``, the repo's ``eval_commands``, record the state of
  ``/testbed``, reinstall the repo (its ``install`` command), reset the test files the test patch touches to
  ``base_commit``, apply ``test_patch``, run the repo/version's test command on the test files of the test patch
  (Django: as test modules) between the ``>>>>> Start/End Test Output`` markers, reset the test files again.
  The test and install commands per repo and version are :data:`REPO_VERSION_SPECS`: ``swebench`` 5 no longer
  ships them (its rows carry the finished script), so they are the Python entries of ``swebench`` 4.1.0's
  ``MAP_REPO_VERSION_TO_SPECS`` (``test_cmd``, ``install``, ``eval_commands``; the image build fields are left
  out: the images already exist);
* ``log_parser``: the parser ``swebench`` 5 itself maps the repo to (``MAP_REPO_TO_PARSER_PY``), by its name in
  ``PARSER_REGISTRY``;
* ``eval_type``: ``fail_only`` for ``swebench``'s ``FAIL_ONLY_REPOS``, else ``pass_and_fail``;
* ``image``: the name the harness derives from the instance id (``swebench/sweb.eval.x86_64.<id>:latest``).

Fields a row already has are kept, so a SWE-bench 5 row passes through unchanged. A row that lacks a field the
sandbox or the grader reads, or whose repo/version has no known test command, is refused with a ``ValueError``
that names the field (``prepare`` refuses such rows before any training starts).

``setup=False`` (the local backend) leaves out the steps that set up SWE-bench's image environment: the conda
activation and the reinstall. Locally the tests run with this interpreter, read-only and without network, so
those steps could only fail (a ``pip install`` without network retries for seconds before it does); the rest of
the script is the same. In Docker (``setup=True``) the script is the harness's: in SWE-bench's images conda and
the editable install exist; in an image without conda the activation lines fail and the script goes on, as it
runs under ``set -uxo pipefail`` without ``-e``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["CLASSIC_FIELDS", "REPO_VERSION_SPECS", "complete_instance", "complete_instances", "derive_eval_script",
           "test_directives"]

#: The fields of a classic SWE-bench row (SWE-bench Verified adds ``difficulty``).
CLASSIC_FIELDS = ("repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement", "hints_text",
                  "created_at", "version", "FAIL_TO_PASS", "PASS_TO_PASS", "environment_setup_commit")

#: Fields the sandbox and the grader read from every row, whatever its schema.
_REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")

_TEST_PYTEST = "pytest -rA"
_DJANGO = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
_DJANGO_LOCALE = ["export LANG=en_US.UTF-8", "export LC_ALL=en_US.UTF-8", "export PYTHONIOENCODING=utf8",
                  "export LANGUAGE=en_US:en"]


def _versions(text: str) -> tuple[str, ...]:
    return tuple(text.split())


#: repo -> [(versions, test_cmd, install, eval_commands)], from swebench 4.1.0's MAP_REPO_VERSION_TO_SPECS_PY.
REPO_VERSION_SPECS: dict[str, list[tuple[tuple[str, ...], str, str, list[str]]]] = {
    "astropy/astropy": [
        (_versions("3.0 3.1 3.2 4.1 4.2 4.3 5.0 5.1 5.2 v5.3"), _TEST_PYTEST,
         "python -m pip install -e .[test] --verbose", []),
        (_versions("0.1 0.2 0.3 0.4 1.1 1.2 1.3"), "pytest -rA -vv -o console_output_style=classic --tb=no",
         "python -m pip install -e .[test] --verbose", []),
    ],
    "django/django": [
        (_versions("1.7 1.8 1.10 1.11 2.0 2.1 2.2"), _DJANGO, "python setup.py install", _DJANGO_LOCALE),
        (_versions("1.9"), "./tests/runtests.py --verbosity 2", "python setup.py install", _DJANGO_LOCALE),
        (_versions("1.4 1.5 1.6"), _DJANGO, "python setup.py install", []),
        (_versions("3.0 3.1 3.2"), _DJANGO, "python -m pip install -e .",
         ["sed -i '/en_US.UTF-8/s/^# //g' /etc/locale.gen && locale-gen", "export LANG=en_US.UTF-8",
          "export LANGUAGE=en_US:en", "export LC_ALL=en_US.UTF-8"]),
        (_versions("4.0 4.1 4.2 5.0 5.1 5.2"), _DJANGO, "python -m pip install -e .", []),
    ],
    "matplotlib/matplotlib": [
        (_versions("3.0 3.1 3.2 3.3 3.4 3.5 3.6 3.7"), _TEST_PYTEST, "python -m pip install -e .", []),
        (_versions("3.8 3.9"), _TEST_PYTEST, 'python -m pip install --no-build-isolation -e ".[dev]"', []),
        (_versions("1.0 1.1 1.2 1.3 1.4 1.5 2.0 2.1 2.2"), _TEST_PYTEST,
         "python setup.py build; python setup.py install", []),
    ],
    "marshmallow-code/marshmallow": [
        (_versions("2.18 2.19 2.20 3.0 3.1 3.2 3.4 3.8 3.9 3.10 3.11 3.12 3.13 3.15 3.16 3.19"), _TEST_PYTEST,
         "python -m pip install -e '.[dev]'", []),
    ],
    "mwaskom/seaborn": [
        (_versions("0.11"), "pytest --no-header -rA", "python -m pip install -e .", []),
        (_versions("0.12 0.13 0.14"), "pytest --no-header -rA", "python -m pip install -e .[dev]", []),
    ],
    "pallets/flask": [(_versions("2.0 2.1 2.2 2.3 3.0 3.1"), _TEST_PYTEST, "python -m pip install -e .", [])],
    "psf/requests": [
        (_versions("0.7 0.8 0.9 0.11 0.13 0.14 1.1 1.2 2.0 2.2 2.3 2.4 2.5 2.7 2.8 2.9 2.10 2.11 2.12 2.17 2.18 "
                   "2.19 2.22 2.25 2.26 2.27 2.31 3.0"), _TEST_PYTEST, "python -m pip install .", []),
    ],
    "pvlib/pvlib-python": [
        (_versions("0.1 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9"), _TEST_PYTEST, "python -m pip install -e .[all]", []),
    ],
    "pydata/xarray": [
        (_versions("0.12 0.18 0.19 0.20 2022.03 2022.06 2022.09 2023.07 2024.05"), _TEST_PYTEST,
         "python -m pip install -e .", []),
    ],
    "pydicom/pydicom": [
        (_versions("1.0 1.1 1.2 1.3 1.4 2.0 2.1 2.2 2.3 2.4 3.0"), _TEST_PYTEST, "python -m pip install -e .", []),
    ],
    "pylint-dev/astroid": [
        (_versions("2.5 2.6 2.7 2.8 2.9 2.10 2.12 2.13 2.14 2.15 2.16 3.0"), _TEST_PYTEST,
         "python -m pip install -e .", []),
    ],
    "pylint-dev/pylint": [
        (_versions("2.8 2.9 2.10 2.11 2.13 2.14 2.15 2.16 2.17 3.0 3.1 3.2 3.3 4.0"), _TEST_PYTEST,
         "python -m pip install -e .", []),
    ],
    "pytest-dev/pytest": [
        (_versions("4.4 4.5 4.6 5.0 5.1 5.2 5.3 5.4 6.0 6.2 6.3 7.0 7.1 7.2 7.4 8.0 8.1 8.2 8.3 8.4"),
         _TEST_PYTEST, "python -m pip install -e .", []),
    ],
    "pyvista/pyvista": [
        (tuple(f"0.{minor}" for minor in range(20, 44)), _TEST_PYTEST, "python -m pip install -e .", []),
    ],
    "scikit-learn/scikit-learn": [
        (_versions("0.20 0.21 0.22 1.3 1.4 1.5 1.6"), _TEST_PYTEST,
         "python -m pip install -v --no-use-pep517 --no-build-isolation -e .", []),
    ],
    "sphinx-doc/sphinx": [
        (_versions("1.5 1.6 1.7 1.8 2.0 2.1 2.2 2.3 2.4 3.0 3.1 3.2 3.3 3.4 3.5 4.0 4.1 4.2 4.3 4.4 4.5 5.0 5.1 "
                   "5.2 5.3 6.0 6.2 7.0 7.1 7.2 7.3 7.4 8.0 8.1"), "tox --current-env -epy39 -v --",
         "python -m pip install -e .[test]", []),
    ],
    "sqlfluff/sqlfluff": [
        (_versions("0.4 0.5 0.6 0.8 0.9 0.10 0.11 0.12 0.13 1.0 1.1 1.2 1.3 1.4 2.0 2.1 2.2"), _TEST_PYTEST,
         "python -m pip install -e .", []),
    ],
    "sympy/sympy": [
        (_versions("0.7 1.0 1.1 1.2 1.4 1.5 1.6 1.7 1.8 1.9 1.10 1.11 1.12 1.13 1.14"),
         "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose",
         "python -m pip install -e .", []),
    ],
}

_HEREDOC_DELIMITER = "EOF_114329324912"
_REPO_DIRECTORY = "/testbed"
_ENV_NAME = "testbed"
_CONDA = ["source /opt/miniconda3/bin/activate", f"conda activate {_ENV_NAME}"]


def _spec(repo: str, version: str) -> tuple[str, str, list[str]] | None:
    for versions, test_cmd, install, eval_commands in REPO_VERSION_SPECS.get(repo, ()):
        if version in versions:
            return test_cmd, install, eval_commands
    return None


def _modified_files(patch: str) -> list[str]:
    """Files the patch changes that exist before it (swebench 4.x ``get_modified_files``)."""
    from unidiff import PatchSet  # a dependency of swebench

    return [f.source_file[2:] for f in PatchSet(patch)
            if f.source_file != "/dev/null" and f.source_file.startswith("a/")]


def test_directives(repo: str, test_patch: str) -> list[str]:
    """What the test command runs: the files of ``test_patch`` that are not data files (Django: test modules)."""
    from swebench.harness.constants import NON_TEST_EXTS

    directives = [d for d in re.findall(r"diff --git a/.* b/(.*)", test_patch)
                  if not any(d.endswith(ext) for ext in NON_TEST_EXTS)]
    if repo == "django/django":
        # runtests.py takes dotted module names relative to tests/
        directives = [d.removesuffix(".py").removeprefix("tests/").replace("/", ".") for d in directives]
    return directives


def derive_eval_script(instance: Mapping[str, Any], setup: bool = True) -> str:
    """The evaluation script of a classic row, built as ``swebench`` 4.x's ``make_eval_script_list_py`` did.

    Args:
        instance: a row with ``repo``, ``version``, ``base_commit`` and ``test_patch``.
        setup: include the image environment steps (conda activation, reinstall of the repository); False for
            the local backend, see the module docstring.

    Raises:
        ValueError: no test command is known for the row's repo and version.
    """
    repo, version = instance["repo"], instance["version"]
    spec = _spec(repo, version)
    if spec is None:
        known = ", ".join(v for versions, *_ in REPO_VERSION_SPECS.get(repo, ()) for v in versions)
        raise ValueError(
            f"swebench: instance {instance.get('instance_id')!r} has no 'eval_script' and none can be derived: no "
            f"test command is known for repo {repo!r} version {version!r} "
            f"({'known versions: ' + known if known else 'unknown repo; known repos: ' + ', '.join(REPO_VERSION_SPECS)}"
            "). Give the row an 'eval_script' (with 'log_parser' and 'eval_type'), as in the SWE-bench 5 schema")
    test_cmd, install, eval_commands = spec
    base_commit, test_patch = instance["base_commit"], instance["test_patch"]
    test_files = " ".join(_modified_files(test_patch))
    reset_tests = f"git checkout {base_commit} {test_files}"
    lines = [*(_CONDA if setup else []), f"cd {_REPO_DIRECTORY}", *eval_commands,
             f"git config --global --add safe.directory {_REPO_DIRECTORY}", f"cd {_REPO_DIRECTORY}",
             "git status", "git show", f"git -c core.fileMode=false diff {base_commit}"]
    if setup:
        lines += [*_CONDA, install]
    lines += [
        reset_tests,
        f"git apply -v - <<'{_HEREDOC_DELIMITER}'\n{test_patch}\n{_HEREDOC_DELIMITER}",
        ": '>>>>> Start Test Output'",
        " ".join([test_cmd, *test_directives(repo, test_patch)]),
        ": '>>>>> End Test Output'",
        reset_tests,
    ]
    return "\n".join(["#!/bin/bash", "set -uxo pipefail", *lines]) + "\n"


def _log_parser_name(repo: str) -> str | None:
    from swebench.harness.log_parsers import PARSER_REGISTRY
    from swebench.harness.log_parsers.python import MAP_REPO_TO_PARSER_PY

    parser = MAP_REPO_TO_PARSER_PY.get(repo)
    if parser is None:
        return None
    # several registry names share one function (parse_log_requests is parse_log_pytest_options); prefer the repo's
    names = [name for name, fn in PARSER_REGISTRY.items() if fn is parser]
    return next((n for n in names if n.removeprefix("parse_log_") in repo), names[0] if names else None)


def _missing(instance: Mapping[str, Any], field: str, why: str) -> ValueError:
    return ValueError(f"swebench: instance {instance.get('instance_id', '<no instance_id>')!r} has no {field!r} "
                      f"field ({why}); classic SWE-bench rows need {', '.join(CLASSIC_FIELDS)}")


def _check_tests(instance: Mapping[str, Any], field: str) -> None:
    value = instance[field]
    try:
        tests = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        raise ValueError(f"swebench: instance {instance['instance_id']!r}: {field} is not a JSON list of test "
                         f"names: {exc}") from exc
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"swebench: instance {instance['instance_id']!r}: {field} must be a list of test names "
                         "(or its JSON string, as published)")


def complete_instance(instance: Mapping[str, Any], setup: bool = True) -> dict[str, Any]:
    """``instance`` with the SWE-bench 5 fields it lacks derived (see the module docstring); a new dict.

    Args:
        instance: a classic SWE-bench row (e.g. SWE-bench Verified as published) or a SWE-bench 5 row.
        setup: derive an ``eval_script`` that sets up SWE-bench's image environment (Docker backend); False for
            the local backend. Ignored when the row has its own ``eval_script``.

    Raises:
        ValueError: a field the sandbox or the grader reads is missing and cannot be derived; the message names it.
    """
    row = dict(instance)
    for field in _REQUIRED:
        if row.get(field) is None:
            raise _missing(row, field, "the sandbox and the grader read it")
    for field in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        _check_tests(row, field)
    if not row.get("eval_script"):
        if row.get("version") is None:
            raise _missing(row, "version", "it selects the test command of the repo when the row has no "
                                           "'eval_script'")
        if not isinstance(row["version"], str):
            # a float version would lose digits ("3.10" -> 3.1), so only the published strings are matched
            raise ValueError(f"swebench: instance {row['instance_id']!r}: 'version' must be a string as published "
                             f"(e.g. '3.0'), not {row['version']!r}")
        row["eval_script"] = derive_eval_script(row, setup=setup)
    if not row.get("log_parser"):
        name = _log_parser_name(row["repo"])
        if name is None:
            raise _missing(row, "log_parser", f"swebench maps no log parser to repo {row['repo']!r}; name one of "
                                              "swebench.harness.log_parsers.PARSER_REGISTRY")
        row["log_parser"] = name
    if not row.get("eval_type"):
        from swebench.harness.constants import FAIL_ONLY_REPOS

        row["eval_type"] = "fail_only" if row["repo"] in FAIL_ONLY_REPOS else "pass_and_fail"
    if not row.get("image"):
        from swebench.task.checks import expected_image

        row["image"] = expected_image(str(row["instance_id"]))
    return row


def complete_instances(instances: Iterable[Mapping[str, Any]], setup: bool = True) -> list[dict[str, Any]]:
    """:func:`complete_instance` of each row (the first bad row raises)."""
    return [complete_instance(instance, setup=setup) for instance in instances]
