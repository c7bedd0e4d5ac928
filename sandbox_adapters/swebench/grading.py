"""Grade a SWE sandbox episode with the real SWE-bench code: ``make_test_spec`` + ``get_eval_report``.

What the official Docker harness does, confined (``confine``) or in the instance's image (``docker``):

1. extract the agent's change as a patch: ``git diff --binary <base_commit>`` over every tracked and untracked,
   non-ignored file of the workspace **except the protected paths** (``protected``: tests, ``conftest.py``, test
   and packaging configuration, ``sitecustomize``/``.pth`` files, plugin registrations, whatever the evaluation
   script names), which therefore stay as in the pristine checkout. git runs inside the sandbox: the workspace's
   ``.git/config`` is agent-written and could name a program for git to run;
2. copy the task's pristine checkout (the origin layer) to a fresh directory, ``git apply`` the patch there
   (falling back to ``patch --fuzz=5`` like the harness), and log SWE-bench's "Applied Patch" / "Patch Apply
   Failed" markers;
3. run the instance's ``eval_script`` (from ``make_test_spec``), with a canary test that must fail when the test
   command is pytest over whole files, in that copy at ``/testbed``, appending its output to the log, or the
   "Tests Timed Out" marker;
4. ``swebench.harness.grading.get_eval_report`` on that log decides ``resolved``; a log whose canary did not fail
   was forged and is unresolved.

``swebench`` is imported lazily so that the rest of the adapter works (and reports a clear error) without it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from sandbox_adapters.swebench.confine import RunResult
from sandbox_adapters.swebench.protected import canary_step, forged_canary, protected_pathspecs

__all__ = ["GradeResult", "Runner", "ExtractedPatch", "extract_patch", "grade_patch", "swebench_available"]

_EXTRACT_PATCH = r"""
export GIT_INDEX_FILE=/tmp/bpo-grading-index
git add -A . >/dev/null 2>&1 || exit 3
base=$1; shift
git diff --cached --name-only --no-renames "$base" > /tmp/bpo-changed || exit 4
git diff --cached --name-only --no-renames "$base" -- . "$@" > /tmp/bpo-kept || exit 4
grep -vxF -f /tmp/bpo-kept /tmp/bpo-changed | sed 's/^/# excluded: /'
echo '# patch follows'
exec git diff --cached --binary --no-color --no-ext-diff --no-renames "$base" -- . "$@"
"""

_APPLY_PATCH = r"""
if git apply --verbose /tmp/model.patch; then echo "$1"
elif patch --batch --fuzz=5 -p1 -i /tmp/model.patch; then echo "$1"
else echo "$2"; exit 1
fi
"""


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
        patch: a git patch of every change outside the protected paths ('' for none).
        excluded: changed paths that are protected and were left out.
    """

    patch: str
    excluded: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class GradeResult:
    """Outcome of grading one patch.

    Attributes:
        resolved: SWE-bench's verdict (all FAIL_TO_PASS and PASS_TO_PASS tests pass), and no forged report.
        report: the ``get_eval_report`` entry of the instance (``tests_status`` included).
        log: the evaluation log that was graded.
        forged: the canary test did not fail: the run's reporting was tampered with.
    """

    resolved: bool
    report: Mapping[str, Any]
    log: str
    forged: bool = False


def extract_patch(runner: Runner, base_commit: str, eval_script: str, timeout_s: float) -> ExtractedPatch | None:
    """The workspace's change against ``base_commit`` outside the protected paths, or None when git fails."""
    result = runner.run(_EXTRACT_PATCH, [base_commit, *protected_pathspecs(eval_script)], timeout_s=timeout_s)
    if result.returncode != 0 or result.truncated:
        return None
    text = result.output.decode("utf-8", "surrogateescape")
    header, sep, patch = text.partition("# patch follows\n")
    if not sep:
        return None
    excluded = tuple(line.removeprefix("# excluded: ") for line in header.splitlines()
                     if line.startswith("# excluded: "))
    return ExtractedPatch(patch, excluded)


def grade_patch(
    instance: Mapping[str, Any],
    model_patch: str | None,
    origin_dir: str,
    make_runner: Callable[[str], Runner],
    uid: int | None,
    timeout_s: float,
) -> GradeResult:
    """Grade ``model_patch`` on a fresh copy of ``origin_dir`` with the real SWE-bench grading code."""
    from swebench.harness.constants import APPLY_PATCH_FAIL, APPLY_PATCH_PASS, TESTS_TIMEOUT
    from swebench.harness.grading import get_eval_report
    from swebench.harness.utils import make_test_spec

    spec = make_test_spec(dict(instance))
    eval_script, canary = canary_step(spec.eval_script, instance.get("test_patch", ""))
    prediction = {"instance_id": instance["instance_id"], "model_patch": model_patch, "model_name_or_path": "bpo"}
    work = tempfile.mkdtemp(prefix="bpo-swe-grade-")
    try:
        testbed = os.path.join(work, "testbed")
        subprocess.run(["cp", "-a", "--", origin_dir, testbed], check=True, capture_output=True)
        if uid is not None:
            subprocess.run(["chown", "-R", "--no-dereference", f"{uid}:{uid}", testbed], check=True)
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
        if APPLY_PATCH_FAIL not in "".join(log_parts):
            ran = runner.run(eval_script, timeout_s=timeout_s)
            log_parts.append(ran.output.decode("utf-8", "replace"))
            if ran.timed_out:
                log_parts.append(f"\n{TESTS_TIMEOUT}\n")
            finished = not ran.timed_out
        log = "".join(log_parts)
        log_path = os.path.join(work, "eval.log")
        with open(log_path, "w") as f:
            f.write(log)
        report = get_eval_report(spec, prediction, log_path, include_tests_status=True)[instance["instance_id"]]
        forged = finished and forged_canary(log, canary)
        return GradeResult(resolved=bool(report["resolved"]) and not forged, report=report, log=log, forged=forged)
    finally:
        shutil.rmtree(work, ignore_errors=True)
