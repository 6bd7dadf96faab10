"""The suite's goal rule for one limited tenant (bench/gpu/suite_analysis.single_goal): how a
GPU-time limit is judged from NVML busy shares on the H200."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def analysis(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "bench" / "gpu"))
    for name in ("suite_analysis", "suite_plan"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module("suite_analysis")


@pytest.mark.parametrize(("busy", "secs", "ok"), [
    (31.0, [31.0, 33.0], (True, True)),
    (33.5, [33.0, 34.0], (False, False)),
    (29.0, [29.0, 26.5], (True, False)),
])
def test_a_tenant_that_wants_more_is_judged_against_its_limit(analysis, busy, secs, ok) -> None:
    assert analysis.single_goal(busy, secs, 60.0, 30.0, 80.0) == ok


@pytest.mark.parametrize(("busy", "secs", "share", "ok"), [
    (46.0, [45.0, 47.0], 105.3, (True, True)),    # faster than its native run: not held back
    (41.0, [40.0, 42.0], 98.5, (True, True)),
    (36.0, [36.0, 36.5], 86.0, (False, False)),   # throttled below its native busy
    (41.0, [40.0, 42.0], 95.0, (False, True)),    # the busy is right but the throughput is not
    (54.0, [53.0, 55.0], 120.0, (False, False)),  # over the limit
])
def test_a_tenant_that_wants_less_must_be_neither_held_back_nor_over(analysis, busy, secs, share, ok) -> None:
    assert analysis.single_goal(busy, secs, share, 50.0, 41.6) == ok


def test_no_whole_second_is_no_steadiness(analysis) -> None:
    assert analysis.single_goal(30.0, [], None, 30.0, 80.0) == (True, False)
