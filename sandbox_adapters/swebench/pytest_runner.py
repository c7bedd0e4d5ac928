"""The grader's pytest runner, copied by ``grading`` into a grader-owned directory of the graded copy and run as
``python -I -B --check-hash-based-pycs always pytest_runner.py ...`` in the sandbox or container.

Standalone (the standard library and the environment's pytest only) and written for every Python that SWE-bench
images ship, so it can run in any of them. Two modes:

* ``--insert-canary TARGET SPEC``: insert the canary test of ``SPEC`` (JSON: ``source``, ``place`` in [0, 1))
  before a top-level test of ``TARGET`` chosen by ``place`` (or at its end), then delete ``SPEC``, so the code under
  test finds no file that names the canary;
* ``RUN``: run pytest as the JSON file ``RUN`` says (``args``, ``report``, ``cwd_first``; the file is deleted
  first, so the test process's command line names neither the tests nor the report), with the grader's recorder
  plugin, which writes every test's phases, whether its call raised, and the session's exit status to ``report``
  (JSON) at the end of the session.

Before pytest is imported, every ``sys.path`` entry inside the repository (``/testbed`` from an editable install's
``.pth``, the script's directory before Python 3.11) is taken off, pytest, all of ``_pytest`` and the environment's
``pytest11`` plugins are imported, and then the entries are put back: a module of the repository cannot shadow the
runner. ``cwd_first`` puts the working directory first afterwards, as ``python -m pytest`` does.
"""

import ast
import json
import os
import sys


def _compiles(text):
    try:
        compile(text, "canary", "exec", ast.PyCF_ONLY_AST)
    except (SyntaxError, ValueError):
        return False
    return True


def _insert_canary(target, spec_path):
    """Insert the canary before a top-level test chosen by ``place`` (its decorators included), or at the end; its
    plain form where this Python cannot compile the clone, at the end where the file would not compile."""
    with open(spec_path) as f:
        spec = json.load(f)
    os.remove(spec_path)
    with open(target) as f:
        text = f.read()
    lines = text.splitlines(True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    starts = []
    if _compiles(text):
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                starts.append(min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1)
    starts.append(len(lines))
    at = starts[min(int(spec["place"] * len(starts)), len(starts) - 1)]
    source = spec["source"] if _compiles(spec["source"]) else spec["fallback"]
    new = "".join(lines[:at]) + "\n\n" + source + "\n\n" + "".join(lines[at:])
    if not _compiles(new):
        new = "".join(lines) + "\n\n" + spec["fallback"]
    with open(target, "w") as f:
        f.write(new)


def _entry_point_plugins():
    """The ``pytest11`` plugins the environment (not the repository) registers; autoload is off."""
    try:
        from importlib import metadata
    except ImportError:
        return []
    try:
        eps = metadata.entry_points()
        group = eps.select(group="pytest11") if hasattr(eps, "select") else eps.get("pytest11", [])
    except Exception:
        return []
    plugins = []
    for ep in group:
        try:
            plugins.append(ep.load())
        except Exception:
            pass
    return plugins


def _make_recorder(pytest, report_path):
    class Recorder(object):
        """Records each test's phases and whether its call raised, and writes them when the session ends."""

        def __init__(self):
            self.tests = {}

        def _entry(self, nodeid):
            return self.tests.setdefault(nodeid, {"phases": {}, "raised": False, "xfail": False})

        @pytest.hookimpl(hookwrapper=True, tryfirst=True)
        def pytest_runtest_call(self, item):
            outcome = yield
            # seen here, below the report: a later rewrite of the report cannot hide that the test raised
            if outcome.excinfo is not None:
                self._entry(item.nodeid)["raised"] = True

        def pytest_runtest_logreport(self, report):
            entry = self._entry(report.nodeid)
            entry["phases"][report.when] = report.outcome
            if hasattr(report, "wasxfail"):
                entry["xfail"] = True

        @pytest.hookimpl(trylast=True)
        def pytest_sessionfinish(self, session, exitstatus):
            tmp = report_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"exitstatus": int(exitstatus), "tests": self.tests}, f)
            os.rename(tmp, report_path)

    return Recorder()


def main(argv):
    if argv[0] == "--insert-canary":
        _insert_canary(argv[1], argv[2])
        return 0
    with open(argv[0]) as f:
        run = json.load(f)
    os.remove(argv[0])
    repo = os.path.realpath(os.getcwd())

    def in_repo(path):
        path = os.path.realpath(path or ".")
        return path == repo or path.startswith(repo + os.sep)

    dropped = [(i, p) for i, p in enumerate(sys.path) if in_repo(p)]
    sys.path[:] = [p for p in sys.path if not in_repo(p)]
    import importlib
    import pkgutil

    try:
        import _pytest
        import pytest
    except ImportError:  # the repository is the runner (pytest's own): it is the code under test then
        for i, path in dropped:
            sys.path.insert(i, path)
        dropped = []
        import _pytest
        import pytest

    for info in pkgutil.walk_packages(_pytest.__path__, "_pytest."):
        try:
            importlib.import_module(info.name)
        except Exception:
            pass
    plugins = _entry_point_plugins()
    for i, path in dropped:
        sys.path.insert(i, path)
    if run["cwd_first"]:
        sys.path.insert(0, repo)
    plugins.append(_make_recorder(pytest, run["report"]))
    return int(pytest.main(run["args"], plugins=plugins))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
