"""The grader's pytest runner, copied by ``grading`` into a grader-owned directory of the graded copy and run as
``python -I -B --check-hash-based-pycs always pytest_runner.py ...`` in the sandbox or container.

Standalone (the standard library and the environment's pytest only) and written for every Python that SWE-bench
images ship, so it can run in any of them. Two modes:

* ``--insert-canary TARGET SPEC``: insert the canary test of ``SPEC`` (JSON: ``source``, ``place`` in [0, 1))
  before a top-level test of ``TARGET`` chosen by ``place`` (or at its end), then delete ``SPEC``, so the code under
  test finds no file that names the canary;
* ``RUN``: run pytest as the JSON file ``RUN`` says (``args``, ``report``, ``cwd_first``; the file is deleted
  first, so the test process's command line names neither the tests nor the report), with the grader's recorder
  plugin, which sends every test's phases, whether its call raised, and the session's exit status (JSON) through
  a pipe at the end of the session. pytest runs in a child process; this one, the guard, runs none of the code
  under test: when the child has exited it stops and then SIGKILLs every process of the sandbox's pid namespace
  started since itself but its ancestors (daemons the code under test left, ``setsid`` or not; processes of
  another uid are out of its reach and hold nothing), until none is left, resumes its ancestors (a stopped shell
  would hang the run), and only then writes the report to ``report`` and exits with the child's status. So nothing
  of the code under test runs any more to rewrite the report, the exit status the evaluation script records next,
  or the log. No report is written when the child was killed by a signal, or a process would not die.

Before pytest is imported, every ``sys.path`` entry inside the repository (``/testbed`` from an editable install's
``.pth``, the script's directory before Python 3.11) is taken off, pytest, all of ``_pytest`` and the environment's
``pytest11`` plugins are imported, and then the entries are put back: a module of the repository cannot shadow the
runner. ``cwd_first`` puts the working directory first afterwards, as ``python -m pytest`` does.
"""

import ast
import json
import os
import signal
import sys
import threading
import time

#: The most report bytes the guard takes from the test process.
_MAX_REPORT_BYTES = 64 << 20


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


def _make_recorder(pytest, report_fd):
    class Recorder(object):
        """Records each test's phases and whether its call raised, and sends them to the guard when the session
        ends."""

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
            data = json.dumps({"exitstatus": int(exitstatus), "tests": self.tests}).encode("utf-8")
            while data:
                data = data[os.write(report_fd, data):]
            os.close(report_fd)

    return Recorder()


def _stat(pid):
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _ancestors():
    pids, pid = [], os.getppid()
    while pid > 0 and pid not in pids:
        pids.append(pid)
        fields = _stat(pid)
        pid = int(fields[1]) if fields else 0
    return pids


def _sweep(keep, deadline_s=60.0):
    """SIGKILL every live process started since this one (its start time or later) but those of ``keep``, until
    none is left; True when none is left, False when the deadline passed first. Each is stopped first: a stopped
    process cannot fork and keeps its slot of the process limit, so a fork bomb cannot refill what is killed."""
    start = int(_stat(os.getpid())[19])
    keep = set(keep)
    deadline = time.time() + deadline_s
    while True:
        live = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in keep:
                continue
            fields = _stat(int(name))
            # a zombie holds no file and runs nothing; an older process is the sandbox's own (its keeper)
            if fields is not None and fields[0] not in "ZXx" and int(fields[19]) >= start:
                live.append((int(name), fields[0]))
        if not live:
            return True
        # the running ones are stopped before the stopped ones are killed, so no slot is freed while they can fork
        signals = sorted((state in "Tt", pid) for pid, state in live)
        for stopped, pid in signals:
            try:
                os.kill(pid, signal.SIGKILL if stopped else signal.SIGSTOP)
            except OSError:
                keep.add(pid)  # not this uid's (or just gone): out of reach, and holds nothing of ours
        if time.time() > deadline:
            return False
        time.sleep(0.001)


def _drain(fd, chunks):
    size = 0
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return
        size += len(chunk)
        chunks.append(chunk if size <= _MAX_REPORT_BYTES else b"\0")  # too large: not JSON


def _write_report(path, data):
    tmp = path + ".tmp"
    try:
        if os.path.lexists(tmp):
            os.remove(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.rename(tmp, path)
    except OSError:
        pass  # no report: the grader finds none


def _guard(child, report_fd, report_path):
    """Wait for the test process, kill whatever it left running, then write its report: nothing of the code under
    test runs any more once the report exists, so nothing can rewrite it, the exit status the script records next,
    or the log."""
    chunks = []
    reader = threading.Thread(target=_drain, args=(report_fd, chunks))
    reader.daemon = True
    reader.start()
    _, status = os.waitpid(child, 0)
    ancestors = _ancestors()
    swept = _sweep([os.getpid(), 1] + ancestors)
    for pid in ancestors:
        if pid != 1:
            try:
                # a daemon may have stopped the shell that waits for this process: the run would hang
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
    reader.join(10)  # every other writer is gone: the pipe ends
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    data = b"".join(chunks)
    if swept and not reader.is_alive():
        try:
            report = json.loads(data.decode("utf-8"))
            valid = isinstance(report, dict) and "exitstatus" in report and "tests" in report
        except ValueError:
            valid = False
        if valid:
            _write_report(report_path, data)
    return os.WEXITSTATUS(status)


def main(argv):
    if argv[0] == "--insert-canary":
        _insert_canary(argv[1], argv[2])
        return 0
    with open(argv[0]) as f:
        run = json.load(f)
    os.remove(argv[0])
    # the tests run in a child; this process runs none of the code under test and outlives it
    report_read, report_write = os.pipe()
    child = os.fork()
    if child:
        os.close(report_write)
        return _guard(child, report_read, run["report"])
    os.close(report_read)
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
    plugins.append(_make_recorder(pytest, report_write))
    return int(pytest.main(run["args"], plugins=plugins))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
