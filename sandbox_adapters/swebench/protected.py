"""Which agent-written files grading ignores, and the canary test, so that nothing the agent writes changes how the
tests run or how their results are read.

An agent under RL learns any way to make the tests report success. Grading therefore takes from the workspace
only the change to the code under test (``grading.extract_patch``): every **protected path** is left as in the
pristine checkout (its edits, additions and deletions are dropped from the graded patch). The rule is one
function, :func:`is_protected`, matched case-insensitively on every path component (a case-insensitive lookup
such as ``importlib.metadata``'s must not find ``HACK.EGG-INFO``). Protected are:

* test code: ``conftest.py`` anywhere; ``test_*.py``, ``*_test.py`` and ``tests.py`` files; everything under a
  directory named ``test``, ``tests`` or ``testing`` (test helpers, fixtures, a test runner such as
  ``sympy/testing/runtests.py``, a test package's ``__init__.py``);
* runner configuration, under every name a pytest up to 9 reads (``pytest.toml``, ``.pytest.toml``,
  ``pytest.ini``, ``.pytest.ini``, ``pyproject.toml``, ``tox.ini``, ``setup.cfg``) and ``noxfile.py``,
  ``.coveragerc``, anywhere;
* modules that shadow the interpreter's start-up or the runner: ``sitecustomize`` and ``usercustomize`` as
  modules or packages and ``*.pth`` files, anywhere (SWE-bench images put ``/testbed`` on ``sys.path`` ahead of the
  runner's own site directory); ``pytest``, ``_pytest``, ``pluggy``, ``py`` and ``iniconfig`` at the root;
* packaging metadata: anything under a ``*.egg-info``, ``*.dist-info`` or ``*.egg`` directory and ``*.egg-link``
  files (a ``[pytest11]`` entry point there loads a plugin into a run);
* bytecode (``*.pyc``, ``*.pyo``, ``__pycache__``), which the interpreter may run instead of the source next to it;
* ``.gitattributes``, ``.gitmodules`` and everything under ``.git`` (git's own configuration);
* every file of the repository that the instance's evaluation script names (its test runner, e.g. ``bin/test``
  or ``tests/runtests.py``, and its test files).

The rule is by path, so it also drops honest edits to those files; SWE-bench's gold patches do not touch them
(the tests come from the instance's ``test_patch``). What it cannot reach is the code under test itself: its modules
are imported into the test process and may tamper with the runner at run time. Against that, grading runs pytest
through its own runner (``grading``) and adds a **canary** (:func:`make_canary`): a test that must fail, cloned from
one of the task's own new tests and named like the repository's tests, placed at a random position of a test file,
so that a tamperer cannot spare it by its name, message or place; a run in which it does not fail is graded 0.
"""

from __future__ import annotations

import ast
import fnmatch
import random
import re
import shlex

__all__ = ["PROTECTED_NAMES", "PROTECTED_DIRS", "RUNNER_MODULES", "is_protected", "paths_named_in", "test_command",
           "make_canary"]

#: File name patterns protected anywhere in the repository (matched lower-cased).
PROTECTED_NAMES = (
    "conftest.py", "test_*.py", "*_test.py", "tests.py",
    "pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml",
    "noxfile.py", ".coveragerc",
    "sitecustomize.py", "usercustomize.py", "sitecustomize.*.so", "usercustomize.*.so",
    "*.pth", "*.egg-link", "*.pyc", "*.pyo", ".gitattributes", ".gitmodules",
)
#: Directory name patterns whose whole contents are protected, anywhere in the repository (matched lower-cased).
PROTECTED_DIRS = (
    "test", "tests", "testing", "*.egg-info", "*.dist-info", "*.egg", "__pycache__", ".git",
    "sitecustomize", "usercustomize",
)
#: The runner's modules, protected as modules or packages at the repository's root, where ``python -m pytest`` and
#: an editable install put them ahead of the runner's own (deeper, e.g. pytest's ``src/_pytest``, they are code
#: under test; the grader's runner imports pytest with the repository off ``sys.path`` in any case).
RUNNER_MODULES = ("pytest", "_pytest", "pluggy", "py", "iniconfig")

_HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?\n.*?\n\1\n", re.DOTALL)
_PATHLIKE = re.compile(r"^[\w.+-][\w./+-]*$")
_START = ": '>>>>> Start Test Output'"


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


def is_protected(path: str, named: frozenset[str] | set[str] = frozenset()) -> bool:
    """True when the repository-relative ``path`` is protected (see the module docstring); ``named`` holds the
    lower-cased paths of :func:`paths_named_in`."""
    parts = path.lower().strip("/").split("/")
    if "/".join(parts) in named:
        return True
    if any(fnmatch.fnmatchcase(part, pattern) for part in parts[:-1] for pattern in PROTECTED_DIRS):
        return True
    top = parts[0] if len(parts) > 1 else parts[0].split(".", 1)[0] if parts[0].endswith((".py", ".so")) else ""
    if top in RUNNER_MODULES:
        return True
    return any(fnmatch.fnmatchcase(parts[-1], pattern) for pattern in PROTECTED_NAMES)


def test_command(eval_script: str) -> tuple[int, list[str]] | None:
    """The line index and words of the evaluation script's test command, or None without the start marker."""
    lines = eval_script.splitlines()
    try:
        index = lines.index(_START) + 1
        return index, shlex.split(lines[index])
    except (ValueError, IndexError):
        return None


def _test_functions(source: str) -> list[ast.FunctionDef]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test")]


def _added_source(test_patch: str, target: str) -> str:
    """The lines the test patch adds to ``target``, dedented hunks joined (test functions are whole in them)."""
    added: list[str] = []
    current = None
    for line in test_patch.splitlines():
        if line.startswith("+++ "):
            current = line[4:].removeprefix("b/")
        elif current == target and line.startswith("+"):
            added.append(line[1:])
        elif current == target and line.startswith("@@"):
            added.append("")
    return "\n".join(added) + "\n"


def make_canary(test_patch: str, target: str, existing_source: str, rng: random.Random) -> tuple[str, str, str]:
    """A canary test for ``target``: ``(name, source, fallback)``.

    It is a clone of a test function the test patch adds to ``target`` (decorators and fixtures included), so it
    fails like the real new tests while the bug is there, followed by the negation of the clone's last top-level
    assertion (or ``assert False``), so it also fails once the bug is fixed. Its name is new but made of the words
    of the file's test names, as many as one of them has (not another name with a suffix, which a tamperer could
    look for). ``fallback`` is a plain failing comparison under that name, for a patch without a whole test
    function or a Python that cannot compile the clone.
    """
    functions = _test_functions(_added_source(test_patch, target))
    names = sorted({f.name for f in functions} | set(re.findall(r"^def (test\w*)", existing_source, re.MULTILINE)))
    words = sorted({w for n in names for w in n.split("_")[1:] if w.isidentifier()} or {"value", "case"})
    base = rng.choice(functions) if functions else None
    size = len(rng.choice(names).split("_")) - 1 if names else 2
    name = ""
    for attempt in range(100):
        picked = rng.sample(words, min(max(size, 1) + attempt // 20, len(words)))
        name = "test_" + "_".join(picked)
        if name not in names and not any(n.startswith(name + "_") or name.startswith(n + "_") for n in names):
            break
    while name in names:  # a vocabulary too small for a new name
        name += f"_{rng.choice(words)}"
    a = rng.randint(2, 99)
    fallback = f"def {name}():\n    assert {a} == {a + rng.randint(1, 9)}\n"
    if base is None:
        return name, fallback, fallback
    clone = ast.parse(ast.unparse(base)).body[0]
    assert isinstance(clone, ast.FunctionDef)
    clone.name = name
    last = next((s for s in reversed(clone.body) if isinstance(s, ast.Assert)), None)
    test = ast.UnaryOp(ast.Not(), last.test) if last is not None else ast.Constant(False)
    clone.body.append(ast.Assert(test=test, msg=None))
    return name, ast.unparse(ast.fix_missing_locations(clone)) + "\n", fallback
