"""The suite's result files as a device call brings them back (bench/gpu/suite.sh packs the logs
and compresses raw.json): suite.py reports and merges the compressed raw file as the plain one.
Runs the suite's own self-test (fake sampler and workloads, no GPU) for a raw file."""

from __future__ import annotations

import json
import lzma
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "bench" / "gpu" / "suite.py"


def _suite(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SUITE), *args], capture_output=True, text=True, timeout=240,
                          check=False, env=env)


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("selftest")
    env = {**os.environ, "ONLY": "gpt", "PARTS": "single", "MODES": "native kvgpu", "SECS": "1"}
    r = _suite("--selftest", "--out", str(out), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return out / "raw.json"


def _tables(summary: str) -> str:
    return summary.split("\n", 1)[1]  # the title carries the report's own time


def test_a_compressed_raw_file_reports_as_the_plain_one(raw: Path, tmp_path: Path) -> None:
    xz = tmp_path / "raw.json.xz"
    xz.write_bytes(lzma.compress(raw.read_bytes()))
    plain, packed = _suite("--report", str(raw), "--out", str(tmp_path / "a")), \
        _suite("--report", str(xz), "--out", str(tmp_path / "b"))
    assert plain.returncode == packed.returncode == 0, packed.stderr[-2000:]
    a, b = ((tmp_path / d / "summary.md").read_text() for d in ("a", "b"))
    assert "| gpt | 30 % |" in a
    assert _tables(a) == _tables(b)


def test_compressed_raw_files_merge(raw: Path, tmp_path: Path) -> None:
    xz = tmp_path / "raw.json.xz"
    xz.write_bytes(lzma.compress(raw.read_bytes()))
    r = _suite("--merge", str(raw), str(xz), "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((tmp_path / "m" / "results.json").read_text())
    assert len(doc["env"]["calls"]) == 2
    assert {run.get("call") for run in doc["runs"]} == {1, 2}  # each call's runs, the packed one's too
