"""The suite's goal rule for one limited tenant (bench/gpu/suite_analysis.single_goal): how a
GPU-time limit is judged from NVML busy shares on the H200."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fresh(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """bench/gpu's ``name`` imported anew (with suite_plan, which suite_analysis imports)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench" / "gpu"))
    for mod in ("suite_analysis", "suite_plan"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    return importlib.import_module(name)


@pytest.fixture
def analysis(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return _fresh(monkeypatch, "suite_analysis")


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


def _newcomer(ctx_rc: int, answer_s: float) -> dict[str, float | int]:
    keys = ("spawn_to_main_s", "init_s", "ctx_s", "init_ctx_s", "first_alloc_s")
    return {**dict.fromkeys(keys, 0.01), "to_first_answer_s": answer_s, "ctx_rc": ctx_rc, "alloc_rc": 0}


def test_a_refused_context_is_counted_not_timed(analysis) -> None:
    native = {"metrics": {"to_first_answer_s": 0.3, "init_ctx_s": 0.3}}
    rec = {"mode": "kvgpu", "racers": [], "rounds": [_newcomer(2, 0.08), _newcomer(0, 0.33), _newcomer(0, 0.35)]}
    m = analysis.analyze_startup(rec, native)
    assert (m["contexts"], m["rounds"], m["met"]) == (2, 3, True)
    assert m["to_first_answer_s"] == pytest.approx(0.34)


def test_no_context_granted_is_not_a_start_up_met(analysis) -> None:
    native = {"metrics": {"to_first_answer_s": 0.3, "init_ctx_s": 0.3}}
    rec = {"mode": "kvgpu", "racers": [], "rounds": [_newcomer(2, 0.08), _newcomer(2, 0.09)]}
    m = analysis.analyze_startup(rec, native)
    assert (m["contexts"], m["to_first_answer_s"], m["met"]) == (0, None, False)


@pytest.fixture
def plan(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return _fresh(monkeypatch, "suite_plan")


def test_limits_take_1_to_100_per_single_workload(plan) -> None:
    assert plan.parse_limits("gpt:30,100 conv:1") == {"gpt": [30, 100], "conv": [1]}


@pytest.mark.parametrize("item", ["gpt:0", "gpt:101", "gpt:", "gpt:x", "nope:30"])
def test_a_limit_outside_1_to_100_or_of_no_workload_is_refused(plan, item) -> None:
    with pytest.raises(ValueError, match=r"1\.\.100"):
        plan.parse_limits(item)


def test_a_100_percent_limit_is_judged_as_a_tenant_that_wants_less(analysis) -> None:
    """No compute limit: the tenant must keep its native speed (what the hooks cost it)."""
    assert analysis.single_goal(63.6, [60.0, 66.0], 80.1, 100.0, 75.2) == (False, False)
    assert analysis.single_goal(74.0, [73.0, 75.0], 98.0, 100.0, 75.2) == (True, True)
