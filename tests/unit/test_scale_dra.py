"""The scale bench's DRA mode (bench/scale/dra.py, report_dra.py): the fake nodes' slices, the
check of what kube-scheduler allocated, and the DRA-against-extender report rows."""

from __future__ import annotations

from typing import Any

from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode
from kvgpu.devcluster.fakenodes import node_manifest
from kvgpu.dra.slices import DRIVER

from bench.scale import dra, report, report_dra


def _slices() -> list[dict[str, Any]]:
    node = node_manifest(SimulatedNode("gpu-00000", (SimulatedCardSpec(memory_mib=10000, count=2),)))
    return dra.node_slices(node, "default", 10)


def _claim(device: str, memory: str = "3000Mi", cores: str = "30", driver: str = DRIVER) -> dict[str, Any]:
    res = {"driver": driver, "pool": "gpu-00000", "device": device,
           "consumedCapacity": {"memory": memory, "cores": cores, "shares": "1"}}
    return {"status": {"allocation": {"devices": {"results": [res]}}}}


def test_fake_node_slices_carry_every_card_with_its_shares() -> None:
    (s,) = _slices()
    assert s["metadata"]["name"] == f"gpu-00000-{DRIVER}"
    assert s["spec"]["pool"]["name"] == "gpu-00000"
    assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    cap = s["spec"]["devices"][0]["capacity"]
    assert (cap["memory"]["value"], cap["cores"]["value"], cap["shares"]["value"]) == ("10000Mi", "100", "10")


def test_claim_template_and_pod_ask_for_the_seed_slice() -> None:
    t = dra.claim_template("ns1")
    (req,) = t["spec"]["spec"]["devices"]["requests"]
    assert req["exactly"] == {"deviceClassName": DRIVER, "capacity": {"requests": {"memory": "3000Mi", "cores": "30"}}}
    pod = dra.pod_body("p1")
    assert pod["spec"]["resourceClaims"] == [{"name": req["name"], "resourceClaimTemplateName": t["metadata"]["name"]}]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": req["name"]}]
    assert "schedulerName" not in pod["spec"] and not pod["metadata"].get("annotations")


def test_allocations_within_capacity_pass() -> None:
    claims = [_claim("gpu-0"), _claim("gpu-0"), _claim("gpu-0"), _claim("gpu-1"), {"status": {}}]
    got = dra.check_allocations(claims, _slices())
    assert got == {"claims": 5, "allocated": 4, "devices_used": 2, "max_claims_per_device": 3, "over_capacity": []}


def test_allocations_over_a_capacity_or_off_the_slices_are_reported() -> None:
    claims = [_claim("gpu-0", cores="60"), _claim("gpu-0", cores="50"),  # 110 % of the cores
              _claim("gpu-1", memory="6000Mi", cores="0"), _claim("gpu-1", memory="5Gi", cores="0"),  # 11,120 MiB
              _claim("gpu-7"), _claim("gpu-0", cores="0", driver="other.example.com")]
    over = dra.check_allocations(claims, _slices())["over_capacity"]
    assert "gpu-00000/gpu-0: cores 110 > 100" in over
    assert "gpu-00000/gpu-1: memory 11120 > 10000" in over
    assert sum("not a published" in o for o in over) == 2
    assert len(over) == 4


def _burst(kind: str, mode: str, rate: float, phase: str, requests: float = 4.0) -> dict[str, Any]:
    return {"kind": kind, "mode": mode, "pods": 500, "phase": phase, "bound_per_s": rate,
            "api_requests_per_pod": {"POST pods": requests}, "apiserver_cpu_ms_per_pod": requests * 2,
            "create_to_bound_ms": {"p50": 1500, "p99": 3000},
            "cpu_seconds_by_process": {"scheduler-default-scheduler": 5.0, "scheduler-kvgpu-scheduler": 1.0,
                                       "operator": 1.5},
            **({"dra_allocations": {"claims": 500, "allocated": 500, "devices_used": 200,
                                    "max_claims_per_device": 3, "over_capacity": []}} if kind == "dra" else {})}


def _run() -> dict[str, Any]:
    bursts = [_burst("baseline", "stream", 300, "extender"), _burst("gpu", "stream", 100, "extender", 5),
              _burst("baseline", "queued", 400, "extender"), _burst("gpu", "queued", 120, "extender", 5),
              _burst("baseline", "stream", 200, "dra"), _burst("dra", "stream", 50, "dra", 9),
              _burst("baseline", "queued", 250, "dra"), _burst("dra", "queued", 60, "dra", 9)]
    return {"machine": {"cores": 2}, "setup": {"nodes": 1001}, "node_choice": "extender", "bursts": bursts,
            "dra_setup": {"slices": 1001, "devices": 8008, "create_s": 4.0}}


def test_dra_bursts_pair_with_their_own_baseline_and_the_extender_burst() -> None:
    rows = report_dra.dra_rows(_run())
    assert [(r["mode"], r["dra"]["bound_per_s"], r["dra_baseline"]["bound_per_s"], r["gpu"]["bound_per_s"],
             r["gpu_baseline"]["bound_per_s"]) for r in rows] == [("stream", 50, 200, 100, 300),
                                                                  ("queued", 60, 250, 120, 400)]
    # the extender report keeps to the extender phase: DRA bursts and their baselines stay out
    assert [(b["bound_per_s"], g["bound_per_s"]) for b, g in report._pairs(_run())] == [(300, 100), (400, 120)]


def test_dra_table_and_summary_compare_with_extender_mode() -> None:
    table = report_dra.dra_table(_run())
    assert table[2].startswith("| stream 500 | 50.0 | 100.0 | 0.50 | 200.0 / 300.0 | 0.25 | 1.5 / 3.0 | 4 / 9 / 5 "
                               "| 8.0 / 18.0 / 10.0 | 10.0 / 5.0 | POST pods 9 | 500/500 on 200 devices")
    assert table[3].split("|")[7].strip() == "–"  # queued: no create→Bound
    (row,) = report_dra.dra_summary([("1,000 nodes, 2 cores", _run())])
    assert "DRA 50-60 pods/s against extender 100-120, 0.50-0.50 × (2 bursts)" in row
    assert "9-9 API requests per DRA pod" in row and "no device over capacity" in row
    assert "scheduling CPU 10.0-10.0 ms per DRA pod (kube-scheduler) against 5.0-5.0 ms per extender pod" in row
    assert report_dra.dra_summary([("x", {"bursts": _run()["bursts"][:4]})]) == []
    assert "DRA mode on the same nodes and cards" in report.section({"runs": {"1000n-2c": _run()}}, False)


def test_bursts_skipped_for_the_time_budget_are_named() -> None:
    run = {**_run(), "skipped_bursts": ["baseline dra queued 2000", "dra dra queued 2000"]}
    assert "- Not run (`--time-budget` spent): baseline dra queued 2000, dra dra queued 2000." in \
        report.section({"runs": {"1000n-16c": run}}, False)
    assert "Not run" not in report.section({"runs": {"1000n-16c": _run()}}, False)
