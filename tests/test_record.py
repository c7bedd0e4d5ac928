"""``benchmarks/record.py``: a benchmark's last JSON line lands in ``docs/results/<name>.json`` with its command,
and a failed benchmark records nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
record = pytest.importorskip("record")


def run(monkeypatch, tmp_path: Path, *command: str) -> None:
    monkeypatch.setattr(record, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["record.py", "demo_result", "--", sys.executable, "-c", *command])
    record.main()


def test_records_the_last_json_line_and_shows_every_line(monkeypatch, tmp_path, capsys):
    run(monkeypatch, tmp_path, "print('progress 1', flush=True); print('{\"ratio\": 0.5}')")
    saved = json.loads((tmp_path / "demo_result.json").read_text())
    assert saved["result"] == {"ratio": 0.5} and "print(" in saved["command"]
    assert saved["cpu"] == record.cpu_model() and saved["cpu"]  # runs reproduce per kind of machine
    assert "progress 1" in capsys.readouterr().out


def test_a_failed_benchmark_records_nothing(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match="exit status 3"):
        run(monkeypatch, tmp_path, "print('{\"ratio\": 0.5}'); raise SystemExit(3)")
    assert not (tmp_path / "demo_result.json").exists()
