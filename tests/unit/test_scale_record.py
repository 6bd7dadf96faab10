"""Recording the device machine's scale runs into bench/results/scale.json (bench/scale/record.py)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.scale import record


def _run(nodes: int, cores: int, *, dra: bool = False, code: str | None = None) -> dict[str, Any]:
    bursts = [{"kind": "baseline", "mode": "stream", "pods": 500, "phase": "extender", "bound_per_s": 600.0},
              {"kind": "gpu", "mode": "stream", "pods": 500, "phase": "extender", "bound_per_s": 300.0}]
    if dra:
        bursts += [{"kind": "baseline", "mode": "stream", "pods": 500, "phase": "dra", "bound_per_s": 550.0},
                   {"kind": "dra", "mode": "stream", "pods": 500, "phase": "dra", "bound_per_s": 250.0}]
    run = {"date": "2026-12-02T02:00:00Z", "machine": {"cores": cores}, "node_choice": "extender",
           "command": f"python bench/scale/run.py --nodes {nodes}{' --dra' if dra else ''}",
           "setup": {"nodes": nodes + 1}, "bursts": bursts}
    return {**run, "code": code} if code else run


def test_device_runs_get_code_machine_and_command_and_a_spread_row() -> None:
    data: dict[str, Any] = {"runs": {"1000n-2c": _run(1000, 2, code="aaa")},
                            "history_16c": [{"code": "old", "nodes": 1000, "bursts": []},
                                            {"code": "bbb", "nodes": 5000, "bursts": []}]}
    remote = {"runs": {"1000n-16c": _run(1000, 16, dra=True), "5000n-16c": _run(5000, 16)}}
    assert record.record(data, remote, "bbb") == ["1000n-16c", "5000n-16c"]
    r = data["runs"]["1000n-16c"]
    assert r["code"] == "bbb" and r["where"] == record.DEVICE
    assert r["via"] == "bash bench/scale/device.sh --nodes 1000 --dra"
    assert data["runs"]["1000n-2c"]["code"] == "aaa"  # other runs stay
    # the spread table keeps this code's rows only, and the extender phase's bursts of each run
    assert [(h["code"], h["nodes"]) for h in data["history_16c"]] == [("bbb", 5000), ("bbb", 1000), ("bbb", 5000)]
    assert [b["kind"] for b in data["history_16c"][1]["bursts"]] == ["baseline", "gpu"]


def test_a_given_code_replaces_the_one_the_remote_wrote() -> None:
    remote = {"runs": {"1000n-16c": _run(1000, 16, code="aaa+changes")}}
    data: dict[str, Any] = {}
    record.record(data, remote, "bbb")
    assert data["runs"]["1000n-16c"]["code"] == "aaa+changes"  # a default only fills a gap
    record.record(data, remote, "bbb", override=True)
    assert data["runs"]["1000n-16c"]["code"] == "bbb"
    assert [h["code"] for h in data["history_16c"]] == ["bbb"]


def test_a_file_without_runs_is_refused() -> None:
    with pytest.raises(ValueError, match="no 'runs'"):
        record.record({}, {"notes": []}, "x")
