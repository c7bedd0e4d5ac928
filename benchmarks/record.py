"""Keep a benchmark's result where the README can cite it: ``docs/results/<name>.json``.

Every benchmark here prints one JSON object as its last line. This runs one (or reads the log of a finished run) and
writes that object with what it takes to reproduce and judge it: the command, the date, the commit, the machine's
cores and CPU model, and the wall time. The CPU model is there because a run reproduces to the digit only on the
kind of machine that made it: another CPU's floating point draws other samples from the same code and seeds. The
README's summary table cites these files by name and key, and ``tests/test_readme_results.py`` checks every cited
figure against them, so a README figure changes only with a recorded run.

    python benchmarks/record.py variance_quick -- python benchmarks/variance.py --quick
    python benchmarks/record.py variance_quick --log run.log --wall-s 512 -- python benchmarks/variance.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def last_json_line(text: str) -> dict:
    """The last line of ``text`` that is a JSON object (a benchmark's summary)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError("no JSON object line in the output: the benchmark did not finish")


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=RESULTS.parents[1])
    return out.stdout.strip() or "unknown"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def record(name: str, command: list[str], output: str, wall_s: float, note: str, commit: str) -> Path:
    entry = {
        "name": name,
        "command": shlex.join(command),
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "wall_s": round(wall_s, 1),
        "note": note,
        "result": last_json_line(output),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(entry, indent=1, sort_keys=False) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage="%(prog)s NAME [options] -- COMMAND ...")
    parser.add_argument("name", help="the file's stem under docs/results/")
    parser.add_argument("--log", type=Path, help="the output of a finished run instead of running the command")
    parser.add_argument("--wall-s", type=float, help="with --log: the run's wall time")
    parser.add_argument("--note", default="", help="what else a reader must know (load on the machine, ...)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        parser.error("give the benchmark command after --")
    commit = _commit()  # taken before the run: commits may land while a long benchmark runs
    if args.log is not None:
        if args.wall_s is None:
            parser.error("--log needs --wall-s")
        output, wall = args.log.read_text(errors="replace"), args.wall_s
    else:
        start = time.monotonic()
        lines = []
        with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as run:
            for line in run.stdout:  # shown as it comes: a long benchmark's progress is visible while it runs
                sys.stdout.write(line)
                sys.stdout.flush()
                lines.append(line)
        output, wall = "".join(lines), time.monotonic() - start
        if run.returncode != 0:
            sys.exit(f"the benchmark failed with exit status {run.returncode}; nothing recorded")
    print(record(args.name, command, output, wall, args.note, commit))


if __name__ == "__main__":
    main()
