"""Grade a SWE sandbox episode with the real SWE-bench code (``make_test_spec`` + ``get_eval_report``), one path for
both backends, against a policy that optimises against its grader.

1. **The patch is data, not a state of the agent's sandbox.** :func:`extract_patch` compares the workspace's files
   with the pristine checkout (the origin layer) on the host, in Python: no git runs in the workspace (its
   ``.git/config`` and ``.gitattributes`` could name textconv or diff programs whose output would join the patch),
   symlinks and special files are never followed, ``.git`` is not read, the pristine checkout's own ignore rules
   apply, binary files (NUL bytes or not UTF-8) and bytecode are dropped, and every protected path
   (``protected.is_protected``: tests, runner configuration of every name, runner and start-up modules, packaging
   metadata, bytecode) is left out. What remains becomes a git-style text patch, built here.
2. :func:`grade_patch` copies the pristine checkout to a fresh directory, applies that patch there in a fresh
   sandbox or container (``git apply``, else ``patch --fuzz=5`` like the harness), logging SWE-bench's "Applied
   Patch" / "Patch Apply Failed" markers, then runs the instance's ``eval_script`` (which applies the test patch).
3. **A runner the code under test cannot redirect.** When the script's test command is pytest, it runs as
   ``python -I -B --check-hash-based-pycs always pytest_runner.py`` (isolated mode: no ``PYTHON*`` variables, no
   script or working directory on ``sys.path``; bytecode checked against its source), with plugin autoload off
   (the environment's own ``pytest11`` plugins are loaded by the runner, not the repository's), the pristine
   configuration file passed with ``-c`` (or the grader's own) and ``--rootdir /testbed``. The runner imports
   pytest with the repository off ``sys.path`` and records every test's outcome, and whether its call raised
   (below any report a tamperer could rewrite), into a report file of a grader-owned directory; the eval script
   records the exit status beside it. pytest runs in a child of the runner, which, once it has exited, kills every
   process it left behind (``setsid`` daemons too, in the sandbox's pid namespace) before it writes the report: no
   code under test outlives the tests to rewrite the report, the exit status or the log.
4. **A canary** (``protected.make_canary``): a clone of one of the task's new tests that must fail, named from the
   repository's own test names and inserted at a random place of the test file right after the test patch.
5. ``get_eval_report`` on the log decides ``resolved``; the grader's channels must agree with it, or the episode
   is **tampered** (graded 0, ``GradeResult.tampered``): the report is missing (a run cut short, e.g. by
   ``os._exit``, a test process killed by a signal, a process that would not die), its exit status differs from
   the process's, a test raised but was reported passed, the log claims success for a test the runner saw fail or
   never ran, or the canary did not fail in the report or in the log.

What this does not defend:

* **spec gaming**, a change that makes the tests pass without fixing the issue (special-casing the tested inputs,
  a value whose ``__eq__`` is always true, a name exported into the test module by its ``import *`` that the tests
  then call). The tests are the specification; only other tests or review would see it, not test-based grading;
* a tamperer in the code under test that knows this runner: it runs in the test process and can rewrite what the
  runner records too (or kill the runner, which runs as the same uid, and write the report itself). It then has
  to tell the canary from the real new tests, which differ from it only in a name built from the same words; any
  blanket rewrite is caught;
* runners other than pytest (Django's ``tests/runtests.py``, SymPy's ``bin/test``): their scripts run as given,
  graded on the log alone, with the protected paths and the pristine patch extraction as the only defences.

``swebench`` is imported lazily so that the rest of the adapter works (and reports a clear error) without it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import random
import shlex
import shutil
import stat
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

from sandbox_adapters.swebench.confine import RunResult
from sandbox_adapters.swebench.protected import is_protected, make_canary, paths_named_in, test_command

__all__ = ["GradeResult", "Runner", "ExtractedPatch", "HardenedRun", "extract_patch", "harden", "cross_check",
           "grade_patch", "swebench_available"]

_APPLY_PATCH = r"""
if git apply --verbose /tmp/model.patch; then echo "$1"
elif patch --batch --fuzz=5 -p1 -i /tmp/model.patch; then echo "$1"
else echo "$2"; exit 1
fi
"""

#: The runner's source, copied into each graded copy.
_RUNNER_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pytest_runner.py")
#: The configuration names pytest reads, in its order of preference, with the section each must hold.
_PYTEST_CONFIGS = (("pytest.toml", ""), (".pytest.toml", ""), ("pytest.ini", ""), (".pytest.ini", ""),
                   ("pyproject.toml", "[tool.pytest"), ("tox.ini", "[pytest]"), ("setup.cfg", "[tool:pytest]"))
_MAX_TEXT_BYTES = 8 << 20
_SUCCESS = ("PASSED", "XFAIL")
#: pytest options with which a failing canary could be deselected or end the run early.
_SELECTING = frozenset({"-k", "-m", "-x", "--exitfirst", "--maxfail", "--deselect", "--lf", "--last-failed", "--ff",
                        "--sw", "--stepwise"})


class Runner(Protocol):
    """Runs a script in a sandbox (``confine.Confinement`` or ``docker.DockerRunner``)."""

    def run(self, script: str, args: Any = (), stdin: bytes | None = None, timeout_s: float | None = None,
            env: Mapping[str, str] | None = None) -> RunResult: ...


def swebench_available() -> bool:
    """True when the ``swebench`` package (the grading code) can be imported."""
    try:
        import swebench.harness.grading  # noqa: F401
    except ImportError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class ExtractedPatch:
    """The graded part of the agent's change.

    Attributes:
        patch: a git patch of every graded change ('' for none).
        excluded: changed paths left out: protected, binary, bytecode, symlinks and special files.
    """

    patch: str
    excluded: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class GradeResult:
    """Outcome of grading one patch.

    Attributes:
        resolved: SWE-bench's verdict (all FAIL_TO_PASS and PASS_TO_PASS tests pass), and not tampered.
        report: the ``get_eval_report`` entry of the instance (``tests_status`` included).
        log: the evaluation log that was graded.
        tampered: the grader's channels (report file, exit status, log, canary) disagree.
        reasons: what disagreed.
    """

    resolved: bool
    report: Mapping[str, Any]
    log: str
    tampered: bool = False
    reasons: tuple[str, ...] = ()


# --- patch extraction -------------------------------------------------------------------------------------------
def _tree(root: str) -> dict[str, os.stat_result]:
    """Every entry below ``root`` but directories and ``.git``, by relative path, without following symlinks."""
    entries: dict[str, os.stat_result] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d != ".git"]
            filenames = [f for f in filenames if f != ".git"]
        for name in [*filenames, *(d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))]:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            entries[rel] = os.lstat(os.path.join(root, rel))
    return entries


def _read(root: str, rel: str) -> bytes:
    fd = os.open(os.path.join(root, rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        return f.read(_MAX_TEXT_BYTES + 1)


#: A file that is not graded as text: binary, too large, a symlink or a special file.
_UNGRADED = "\0ungraded"


def _text(root: str, rel: str, entry: os.stat_result | None) -> str | None:
    """The file's text, None when it is absent, ``_UNGRADED`` when it is not a regular UTF-8 text file."""
    if entry is None:
        return None
    if not stat.S_ISREG(entry.st_mode):
        return _UNGRADED
    data = _read(root, rel)
    if len(data) > _MAX_TEXT_BYTES or b"\0" in data:
        return _UNGRADED
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return _UNGRADED


def _ignored_by_origin(origin_dir: str, paths: list[str]) -> set[str]:
    """The paths the pristine checkout's ignore rules ignore (git run on the pristine repository only)."""
    if not paths or not os.path.isdir(os.path.join(origin_dir, ".git")):
        return set()
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_ATTR_NOSYSTEM": "1", "LC_ALL": "C"}
    done = subprocess.run(
        ["git", "-c", "safe.directory=*", "-c", "core.attributesFile=/dev/null", "check-ignore", "--no-index",
         "--stdin", "-z"], cwd=origin_dir, env=env, input="\0".join(paths).encode("utf-8", "surrogateescape") + b"\0",
        capture_output=True, timeout=120)
    if done.returncode not in (0, 1):
        return set()
    return {p.decode("utf-8", "surrogateescape") for p in done.stdout.split(b"\0") if p}


def _quote(path: str) -> str:
    if not any(c in path for c in '"\\\t\n') and path.isascii() and path.isprintable():
        return path
    return '"' + "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else
                         {"\\": "\\\\", '"': '\\"', "\t": "\\t", "\n": "\\n"}.get(c) or
                         "".join(f"\\{b:03o}" for b in c.encode("utf-8", "surrogateescape")) for c in path) + '"'


def _lines(text: str) -> list[str]:
    """``text`` split after each newline only (``str.splitlines`` also splits at form feeds, which patch does not)."""
    parts = text.split("\n")
    return [f"{part}\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _file_patch(path: str, old: str | None, new: str | None, old_mode: int, new_mode: int) -> str:
    """A git-style patch of one text file (``None``: absent on that side)."""
    a, b = _quote(f"a/{path}"), _quote(f"b/{path}")
    head = [f"diff --git {a} {b}\n"]
    if old is None:
        head.append(f"new file mode {new_mode:o}\n")
    elif new is None:
        head.append(f"deleted file mode {old_mode:o}\n")
    elif old_mode != new_mode:
        head += [f"old mode {old_mode:o}\n", f"new mode {new_mode:o}\n"]
    old_lines, new_lines = _lines(old or ""), _lines(new or "")
    if old_lines == new_lines:
        return "".join(head) if len(head) > 1 else ""
    lines = list(difflib.unified_diff(old_lines, new_lines, "/dev/null" if old is None else a,
                                      "/dev/null" if new is None else b, n=3))
    out = head + lines[:2]
    for line in lines[2:]:
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def extract_patch(workspace_dir: str, origin_dir: str, eval_script: str = "") -> ExtractedPatch:
    """The workspace's change to the pristine checkout, without protected, ignored, binary or bytecode files."""
    named = {p.lower() for p in paths_named_in(eval_script)}
    old_tree, new_tree = _tree(origin_dir), _tree(workspace_dir)
    changed: list[str] = []
    for rel in sorted(old_tree.keys() | new_tree.keys()):
        old, new = old_tree.get(rel), new_tree.get(rel)
        if old is not None and new is not None and stat.S_IFMT(old.st_mode) == stat.S_IFMT(new.st_mode):
            if stat.S_ISLNK(old.st_mode):
                if os.readlink(os.path.join(origin_dir, rel)) == os.readlink(os.path.join(workspace_dir, rel)):
                    continue
            elif stat.S_ISREG(old.st_mode) and old.st_size == new.st_size and (old.st_mode & 0o111 > 0) == (
                    new.st_mode & 0o111 > 0) and _read(origin_dir, rel) == _read(workspace_dir, rel):
                continue
        changed.append(rel)
    ignored = _ignored_by_origin(origin_dir, [rel for rel in changed if rel not in old_tree])
    excluded, parts = [], []
    for rel in changed:
        if rel in ignored:
            continue
        old, new = old_tree.get(rel), new_tree.get(rel)
        texts = [_text(origin_dir, rel, old), _text(workspace_dir, rel, new)]
        if is_protected(rel, named) or _UNGRADED in texts:
            excluded.append(rel)
            continue
        mode = [0o100755 if e is not None and e.st_mode & 0o111 else 0o100644 for e in (old, new)]
        parts.append(_file_patch(rel, texts[0], texts[1], mode[0], mode[1]))
    return ExtractedPatch("".join(parts), tuple(excluded))


# --- the hardened run -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HardenedRun:
    """The evaluation script rewritten to run pytest through the grader's runner, and what the grader checks.

    Attributes:
        script: the evaluation script to run.
        files: files to write into the grader's directory (name -> content).
        canary: the canary's node id prefix (``<file>::<name>``), or '' for none.
    """

    script: str
    files: Mapping[str, str]
    canary: str


def _pytest_config(origin_dir: str, args: list[str]) -> str | None:
    """The configuration file pytest would read in the pristine checkout, relative to it (None: none)."""
    paths = [p for p in (a.split("::", 1)[0] for a in args if not a.startswith("-"))
             if os.path.exists(os.path.join(origin_dir, p))]  # option values are not paths
    dirs = [os.path.dirname(os.path.normpath(p)) if os.path.splitext(p)[1] else os.path.normpath(p) for p in paths]
    try:
        start = os.path.commonpath(dirs) if dirs else ""
    except ValueError:  # absolute and relative paths mixed
        start = ""
    if start.startswith("..") or os.path.isabs(start):
        start = ""
    while True:
        for name, section in _PYTEST_CONFIGS:
            rel = os.path.normpath(os.path.join(start, name))
            path = os.path.join(origin_dir, rel)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, errors="replace") as f:
                    if not section or section in f.read():
                        return rel
        if start in ("", "."):
            return None
        start = os.path.dirname(start)


def harden(eval_script: str, test_patch: str, origin_dir: str, grader_dir: str, rng: random.Random,
           mount_point: str = "/testbed") -> HardenedRun | None:
    """``eval_script`` with its pytest command run by the grader's runner (with a canary), or None when the test
    command is not pytest (another runner: graded on its log alone). ``grader_dir`` is relative to the repo."""
    found = test_command(eval_script)
    if found is None:
        return None
    index, words = found
    if words[:1] in (["pytest"], ["py.test"]):
        python, args, cwd_first = "python", words[1:], False
    elif len(words) >= 3 and words[0].startswith("python") and words[1:3] == ["-m", "pytest"]:
        python, args, cwd_first = words[0], words[3:], True
    else:
        return None
    config = _pytest_config(origin_dir, args)
    home = f"{mount_point}/{grader_dir}"
    with open(_RUNNER_SOURCE) as f:
        files = {"pytest_runner.py": f.read()}
    extra = ["-p", "no:cacheprovider", f"--rootdir={mount_point}"]
    if config is None:
        files["pytest.ini"] = "[pytest]\n"
        extra += ["-c", f"{home}/pytest.ini", f"--confcutdir={mount_point}"]
    else:
        extra += ["-c", f"{mount_point}/{config}"]
    lines = eval_script.splitlines()
    step = [f"bpo_python={shlex.quote(python)}"]
    patched = [line[6:] for line in test_patch.splitlines() if line.startswith("+++ b/") and line.endswith(".py")]
    targets = [p for p in patched if any(a == p or a.startswith(f"{p}::") for a in args)]
    if any(a.split("=", 1)[0] in _SELECTING for a in args):
        targets = []  # a canary could be deselected, or stop the run before the real tests
    canary = ""
    if targets:
        target = rng.choice(targets)
        existing = ""
        with_origin = os.path.join(origin_dir, target)
        if os.path.isfile(with_origin) and not os.path.islink(with_origin):
            with open(with_origin, errors="replace") as f:
                existing = f.read()
        name, source, fallback = make_canary(test_patch, target, existing, rng)
        canary = f"{target}::{name}"
        files["canary.json"] = json.dumps({"source": source, "fallback": fallback, "place": rng.random()})
        if target not in args:  # the command selects test ids: select the canary too
            args.append(canary)
        step.append(f'"$bpo_python" -I -B {home}/pytest_runner.py --insert-canary {shlex.quote(target)} '
                    f"{home}/canary.json")
    files["run.json"] = json.dumps({"args": [*args, *extra], "report": f"{home}/report.json",
                                    "cwd_first": cwd_first})
    command = (f'bpo_flags="-I -B"; "$bpo_python" -I -B --check-hash-based-pycs always -c "" 2>/dev/null && '
               f'bpo_flags="$bpo_flags --check-hash-based-pycs always"\n'
               f'PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$bpo_python" $bpo_flags {home}/pytest_runner.py {home}/run.json\n'
               f"echo $? > {home}/status")
    script = "\n".join([*lines[:index - 1], *step, lines[index - 1], command, *lines[index + 1:]]) + "\n"
    return HardenedRun(script, files, canary)


def _outcome(test: Mapping[str, Any]) -> str:
    """A test's status, in SWE-bench's words, from the phases the grader's runner recorded."""
    phases = test.get("phases", {})
    if "failed" in (phases.get("setup"), phases.get("teardown")):
        return "ERROR"
    if phases.get("call") == "failed":
        return "FAILED"
    if "skipped" in phases.values():
        return "XFAIL" if test.get("xfail") else "SKIPPED"
    return "PASSED" if phases.get("call") == "passed" else "SKIPPED"


def _read_small(path: str, limit: int = 64 << 20) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(limit).decode("utf-8", "replace")


def cross_check(report_text: str | None, status_text: str | None, log_map: Mapping[str, str], canary: str,
                graded: Collection[str]) -> list[str]:
    """Where the grader's runner report, the recorded exit status, the log's statuses and the canary disagree.

    ``graded``: the FAIL_TO_PASS and PASS_TO_PASS tests. A success the log claims for one of them must be the
    runner's too; other lines that merely look like results (a test of a test runner prints them) are only held
    against the tests the runner ran.
    """
    try:
        report = json.loads(report_text or "")
        tests = {str(k): _outcome(v) for k, v in report["tests"].items()}
        raised = [k for k, v in report["tests"].items() if v.get("raised") and v["phases"].get("call") == "passed"]
        exitstatus = int(report["exitstatus"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return ["the grader's runner wrote no complete report (the test session did not finish)"]
    reasons = [f"{k} raised but was reported passed" for k in raised]
    try:
        status = int((status_text or "").strip())
    except ValueError:
        status = None
    if status != exitstatus:
        reasons.append(f"the test process exited with {status} but its session ended with {exitstatus}")
    truncated = [g for g in graded if g.count("[") > g.count("]")]  # as swebench's own matching tolerates
    for name, claimed in log_map.items():
        if claimed not in _SUCCESS:
            continue
        # a log name is cut at its first space: it may be a prefix of the node id
        seen = tests.get(name) or next((v for k, v in tests.items() if k.startswith(name)), None)
        if seen is None and (name in graded or any(name.startswith(g) for g in truncated)):
            reasons.append(f"the log reports {name} {claimed}, which did not run")
        elif seen is not None and seen not in _SUCCESS:
            reasons.append(f"the log reports {name} {claimed}, but it {seen}")
    if canary:
        ours = [v for k, v in tests.items() if k == canary or k.startswith(canary + "[")]
        logged = [v for k, v in log_map.items() if k == canary or k.startswith(canary + "[")]
        if not ours or any(v not in ("FAILED", "ERROR") for v in ours):
            reasons.append("the canary did not fail in the grader's report")
        if not logged or any(v not in ("FAILED", "ERROR") for v in logged):
            reasons.append("the canary did not fail in the log")
    return reasons


def grade_patch(
    instance: Mapping[str, Any],
    model_patch: str | None,
    origin_dir: str,
    make_runner: Callable[[str], Runner],
    uid: int | None,
    timeout_s: float,
    rng: random.Random | None = None,
) -> GradeResult:
    """Grade ``model_patch`` on a fresh copy of ``origin_dir`` with the real SWE-bench grading code."""
    from swebench.harness.constants import APPLY_PATCH_FAIL, APPLY_PATCH_PASS, TESTS_TIMEOUT
    from swebench.harness.grading import get_eval_report, get_logs_eval
    from swebench.harness.utils import make_test_spec

    spec = make_test_spec(dict(instance))
    rng = rng or random.Random(uuid.uuid4().int)
    prediction = {"instance_id": instance["instance_id"], "model_patch": model_patch, "model_name_or_path": "bpo"}
    work = tempfile.mkdtemp(prefix="bpo-swe-grade-")
    try:
        testbed = os.path.join(work, "testbed")
        subprocess.run(["cp", "-a", "--", origin_dir, testbed], check=True, capture_output=True)
        if uid is not None:
            subprocess.run(["chown", "-R", "--no-dereference", f"{uid}:{uid}", testbed], check=True)
        git_dir = os.path.join(testbed, ".git")
        grader_rel = (".git/" if os.path.isdir(git_dir) and not os.path.islink(git_dir) else ".") + \
            f"bpo-grader-{uuid.uuid4().hex[:16]}"
        hardened = harden(spec.eval_script, instance.get("test_patch", ""), origin_dir, grader_rel, rng)
        runner = make_runner(testbed)
        log_parts: list[str] = []
        finished = False
        if model_patch:
            applied = runner.run(
                f"cat > /tmp/model.patch\n{_APPLY_PATCH}", [APPLY_PATCH_PASS, APPLY_PATCH_FAIL],
                stdin=model_patch.encode("utf-8", "surrogateescape"), timeout_s=timeout_s,
            )
            log_parts.append(applied.output.decode("utf-8", "replace"))
            if applied.returncode != 0:
                log_parts.append(f"\n{APPLY_PATCH_FAIL}\n")
        grader_dir = os.path.join(testbed, grader_rel)
        if APPLY_PATCH_FAIL not in "".join(log_parts):
            if hardened is not None:
                os.mkdir(grader_dir, 0o755)
                for name, content in hardened.files.items():
                    with open(os.path.join(grader_dir, name), "w") as f:
                        f.write(content)
                if uid is not None:
                    subprocess.run(["chown", "-R", "--no-dereference", f"{uid}:{uid}", grader_dir], check=True)
            ran = runner.run(hardened.script if hardened else spec.eval_script, timeout_s=timeout_s)
            log_parts.append(ran.output.decode("utf-8", "replace"))
            if ran.timed_out:
                log_parts.append(f"\n{TESTS_TIMEOUT}\n")
            finished = not ran.timed_out
        log = "".join(log_parts)
        log_path = os.path.join(work, "eval.log")
        with open(log_path, "w") as f:
            f.write(log)
        report = get_eval_report(spec, prediction, log_path, include_tests_status=True)[instance["instance_id"]]
        reasons: list[str] = []
        if finished and hardened is not None:
            log_map, _ = get_logs_eval(spec, log_path)
            reasons = cross_check(_read_small(os.path.join(grader_dir, "report.json")),
                                  _read_small(os.path.join(grader_dir, "status"), 64), log_map, hardened.canary,
                                  {*spec.FAIL_TO_PASS, *spec.PASS_TO_PASS})
        tampered = bool(reasons)
        return GradeResult(resolved=bool(report["resolved"]) and not tampered, report=report, log=log,
                           tampered=tampered, reasons=tuple(reasons))
    finally:
        shutil.rmtree(work, ignore_errors=True)
