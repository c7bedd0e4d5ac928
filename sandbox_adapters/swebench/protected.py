"""Which agent-written files grading ignores, so that nothing the agent writes changes how the tests run.

An agent under RL learns any way to make the tests report success. Grading therefore takes from the workspace
only the change to the code under test: before the evaluation script runs, every **protected path** is restored to
the pristine checkout (its edits, additions and deletions are dropped from the graded patch). Protected are:

* test code: ``conftest.py`` anywhere; ``test_*.py``, ``*_test.py`` and ``tests.py`` files; everything under a
  directory named ``test``, ``tests`` or ``testing`` (test helpers, fixtures, a test runner such as
  ``sympy/testing/runtests.py``, a test package's ``__init__.py``);
* test and packaging configuration: ``pytest.ini``, ``.pytest.ini``, ``tox.ini``, ``setup.cfg``, ``pyproject.toml``,
  ``noxfile.py`` and ``.coveragerc``, anywhere (they carry ``addopts``, plugins, markers and the test paths);
* interpreter start-up hooks: ``sitecustomize.py``, ``usercustomize.py`` and ``*.pth`` files, anywhere (SWE-bench
  images put ``/testbed`` on ``sys.path``, so Python would run them before any test);
* plugin registrations: anything under a ``*.egg-info`` or ``*.dist-info`` directory (a ``[pytest11]`` entry point
  there loads a plugin into every pytest run);
* every file of the repository that the instance's evaluation script names (its test runner, e.g. ``bin/test``
  or ``tests/runtests.py``, and its test files).

The rule is by path, so it also drops honest edits to those files; SWE-bench's gold patches do not touch them
(the tests come from the instance's ``test_patch``). What it cannot reach is the code under test itself: its modules
are imported into the test process, so a patch to them could still tamper with the test framework at import time.
For pytest logs, :func:`canary_step` adds a test to the graded run that must fail; a run in which it passes has
had its reporting forged and is graded unresolved.
"""

from __future__ import annotations

import re
import shlex
import uuid

__all__ = ["PROTECTED_NAMES", "PROTECTED_DIRS", "protected_pathspecs", "paths_named_in", "canary_step",
           "forged_canary"]

#: File name patterns protected anywhere in the repository.
PROTECTED_NAMES = (
    "conftest.py", "test_*.py", "*_test.py", "tests.py",
    "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "noxfile.py", ".coveragerc",
    "sitecustomize.py", "usercustomize.py", "*.pth",
)
#: Directory name patterns whose whole contents are protected, anywhere in the repository.
PROTECTED_DIRS = ("test", "tests", "testing", "*.egg-info", "*.dist-info")

_HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?\n.*?\n\1\n", re.DOTALL)
_PATHLIKE = re.compile(r"^[\w.+-][\w./+-]*$")


def paths_named_in(eval_script: str) -> list[str]:
    """Repository-relative paths the evaluation script names outside its here-documents (the test patch)."""
    words: list[str] = []
    for line in _HEREDOC.sub("\n", eval_script).splitlines():
        try:
            words += shlex.split(line, comments=True)
        except ValueError:
            words += line.split()
    paths = []
    for word in words:
        word = word.split("::", 1)[0].removeprefix("./").removeprefix("/testbed/")
        if word and not word.startswith("/") and _PATHLIKE.match(word) and ("/" in word or "." in word):
            paths.append(word)
    return sorted(set(paths))


def protected_pathspecs(eval_script: str = "") -> list[str]:
    """git pathspecs that exclude every protected path (for ``git diff ... -- . <pathspecs>``)."""
    specs = [f":(exclude,glob)**/{name}" for name in PROTECTED_NAMES]
    specs += [f":(exclude,glob)**/{name}/**" for name in PROTECTED_DIRS]
    specs += [f":(exclude,literal){path}" for path in paths_named_in(eval_script)]
    return specs


def canary_step(eval_script: str, test_patch: str) -> tuple[str, str]:
    """``eval_script`` with a test that must fail appended to a test file of the test patch right after the patch
    is applied, and the canary's name ("" when the script gets none). The name is random, so a forged report
    cannot single it out. Only for a pytest command that runs whole test files (one that selects test ids with
    ``::`` would not collect the canary)."""
    marker = ": '>>>>> Start Test Output'"
    lines = eval_script.splitlines()
    try:
        command = lines[lines.index(marker) + 1]
    except (ValueError, IndexError):
        return eval_script, ""
    if "pytest" not in command or "::" in command:
        return eval_script, ""
    tokens = set(command.split())
    patched = re.findall(r"^\+\+\+ b/(\S+\.py)$", test_patch, flags=re.MULTILINE)
    target = next((path for path in patched if path in tokens or f"./{path}" in tokens), None)
    if target is None:
        return eval_script, ""
    name = f"test_{uuid.uuid4().hex[:12]}"
    append = f"printf '\\n\\ndef {name}():\\n    assert False, \"grading canary\"\\n' >> {shlex.quote(target)}"
    return eval_script.replace(marker, f"{append}\n{marker}", 1), name


def forged_canary(log: str, name: str) -> bool:
    """True when the graded log does not report the canary as failed (passed, skipped or missing)."""
    if not name:
        return False
    return not any(name in line and re.search(r"\bFAILED\b", line) for line in log.splitlines())
