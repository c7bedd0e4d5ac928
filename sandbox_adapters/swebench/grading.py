"""Grade a SWE sandbox episode with the real SWE-bench code: ``make_test_spec`` + ``get_eval_report``.

What the official Docker harness does, done locally and confined (see ``confine``):

1. extract the agent's change as a patch: ``git diff --binary <base_commit>`` over every tracked and untracked,
   non-ignored file of the workspace (run inside the confinement: the workspace's ``.git/config`` is agent-written
   and could name a program for git to run);
2. copy the task's pristine checkout (the origin layer) to a fresh directory, ``git apply`` the patch there
   (falling back to ``patch --fuzz=5`` like the harness), and log SWE-bench's "Applied Patch" / "Patch Apply
   Failed" markers;
3. run the instance's ``eval_script`` (from ``make_test_spec``) under ``bash`` in that copy, bound at ``/testbed``
   as in the official images, appending its output to the log, or the "Tests Timed Out" marker;
4. ``swebench.harness.grading.get_eval_report`` on that log decides ``resolved``.

``swebench`` is imported lazily so that the rest of the adapter works (and reports a clear error) without it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from sandbox_adapters.swebench.confine import Confinement

__all__ = ["GradeResult", "extract_patch", "grade_patch", "swebench_available"]

_EXTRACT_PATCH = r"""
export GIT_INDEX_FILE=/tmp/bpo-grading-index
git add -A . >/dev/null 2>&1 || exit 3
exec git diff --cached --binary --no-color --no-ext-diff --no-renames "$1"
"""

_APPLY_PATCH = r"""
if git apply --verbose /tmp/model.patch; then echo "$1"
elif patch --batch --fuzz=5 -p1 -i /tmp/model.patch; then echo "$1"
else echo "$2"; exit 1
fi
"""


def swebench_available() -> bool:
    """True when the ``swebench`` package (the grading code) can be imported."""
    try:
        import swebench.harness.grading  # noqa: F401
    except ImportError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class GradeResult:
    """Outcome of grading one patch.

    Attributes:
        resolved: SWE-bench's verdict (all FAIL_TO_PASS and PASS_TO_PASS tests pass).
        report: the ``get_eval_report`` entry of the instance (``tests_status`` included).
        log: the evaluation log that was graded.
    """

    resolved: bool
    report: Mapping[str, Any]
    log: str


def extract_patch(confinement: Confinement, base_commit: str, timeout_s: float) -> str | None:
    """The workspace's change against ``base_commit`` as a git patch ('' for none), or None when git fails."""
    result = confinement.run(_EXTRACT_PATCH, [base_commit], timeout_s=timeout_s)
    if result.returncode != 0 or result.truncated:
        return None
    return result.output.decode("utf-8", "surrogateescape")


def grade_patch(
    instance: Mapping[str, Any],
    model_patch: str | None,
    origin_dir: str,
    make_confinement: Callable[[str], Confinement],
    uid: int | None,
    timeout_s: float,
) -> GradeResult:
    """Grade ``model_patch`` on a fresh copy of ``origin_dir`` with the real SWE-bench grading code."""
    from swebench.harness.constants import APPLY_PATCH_FAIL, APPLY_PATCH_PASS, TESTS_TIMEOUT
    from swebench.harness.grading import get_eval_report
    from swebench.harness.utils import make_test_spec

    spec = make_test_spec(dict(instance))
    prediction = {"instance_id": instance["instance_id"], "model_patch": model_patch, "model_name_or_path": "bpo"}
    work = tempfile.mkdtemp(prefix="bpo-swe-grade-")
    try:
        testbed = os.path.join(work, "testbed")
        subprocess.run(["cp", "-a", "--", origin_dir, testbed], check=True, capture_output=True)
        if uid is not None:
            subprocess.run(["chown", "-R", "--no-dereference", f"{uid}:{uid}", testbed], check=True)
        confinement = make_confinement(testbed)
        log_parts: list[str] = []
        if model_patch:
            applied = confinement.run(
                f"cat > /tmp/model.patch\n{_APPLY_PATCH}", [APPLY_PATCH_PASS, APPLY_PATCH_FAIL],
                stdin=model_patch.encode("utf-8", "surrogateescape"), timeout_s=timeout_s,
            )
            log_parts.append(applied.output.decode("utf-8", "replace"))
            if applied.returncode != 0:
                log_parts.append(f"\n{APPLY_PATCH_FAIL}\n")
        if APPLY_PATCH_FAIL not in "".join(log_parts):
            ran = confinement.run(spec.eval_script, timeout_s=timeout_s)
            log_parts.append(ran.output.decode("utf-8", "replace"))
            if ran.timed_out:
                log_parts.append(f"\n{TESTS_TIMEOUT}\n")
        log = "".join(log_parts)
        log_path = os.path.join(work, "eval.log")
        with open(log_path, "w") as f:
            f.write(log)
        report = get_eval_report(spec, prediction, log_path, include_tests_status=True)[instance["instance_id"]]
        return GradeResult(resolved=bool(report["resolved"]), report=report, log=log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
