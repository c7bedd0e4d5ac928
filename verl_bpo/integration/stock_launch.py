"""Fail fast when ``algorithm.adv_estimator=bpo`` is passed to verl's stock ``python -m verl.trainer.main_ppo``.

The stock TaskRunner builds verl's own trainer, which never hands the tree metadata to an estimator, so the run
would load every model and only then fail at the first advantage step. This check runs from the ``verl.plugins``
entry point while ``main_ppo`` is still importing verl, before Ray starts or any model loads, and exits with the
fix. It only looks at the command line of a ``main_ppo`` process; Ray workers and other programs are untouched.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["check_stock_launch", "STOCK_LAUNCH_MESSAGE"]

STOCK_LAUNCH_MESSAGE = (
    "algorithm.adv_estimator=bpo needs the BPO tree agent loop and the BPO trainer, which verl's stock main_ppo "
    "does not use. Run the same command with `python -m verl_bpo.main` instead of `python -m verl.trainer.main_ppo` "
    "(it accepts every verl override, plus the bpo.* block)."
)


def _is_stock_main_ppo(argv: Sequence[str]) -> int | None:
    """Index where main_ppo's own arguments start in the interpreter's command line, or None."""
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] == "verl.trainer.main_ppo":
            return i + 2
        if str(arg).replace("\\", "/").endswith("verl/trainer/main_ppo.py"):
            return i + 1
    return None


def check_stock_launch(argv: Sequence[str] | None = None) -> None:
    # sys.orig_argv: under `python -m`, verl is imported (and this runs) before runpy rewrites sys.argv[0].
    argv = list(sys.orig_argv) if argv is None else list(argv)
    start = _is_stock_main_ppo(argv)
    if start is None:
        return
    for arg in argv[start:]:
        key, _, value = arg.lstrip("+~").partition("=")
        if key == "algorithm.adv_estimator" and value.strip().strip("'\"") == "bpo":
            raise SystemExit(f"verl-bpo: {STOCK_LAUNCH_MESSAGE}")
