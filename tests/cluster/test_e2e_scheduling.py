"""End to end on the real control plane: the mutating webhook, the real kube-scheduler calling
our extender, claims, releases, requeue, and an operator crash in the middle of a burst.
Fake GPU nodes have no kubelet; the tests patch pod status where a kubelet would."""

from __future__ import annotations

import collections
import json
import threading
import time

from tests.cluster.conftest import GpuEnv

SEED = {"kvgpu.io/gpu": "1", "kvgpu.io/gpumem": "3000", "kvgpu.io/gpucores": "30"}


def test_seed_pod_gets_a_claim_and_is_bound(gpu: GpuEnv) -> None:
    gpu.nodes(1, cards=2)
    gpu.create(gpu.pod("seed", SEED))
    pod = gpu.wait_bound("seed")
    ann = pod["metadata"]["annotations"]
    assert pod["spec"]["schedulerName"] == "kvgpu-scheduler"
    claim_str = ann["kvgpu.io/claim.main"]
    assert claim_str.startswith("v1;claim=") and ",3000,30" in claim_str
    [claim] = gpu.claims()
    assert claim["spec"]["podUID"] == pod["metadata"]["uid"]
    assert claim["spec"]["devices"][0]["memory"] == 3000 and claim["spec"]["devices"][0]["cores"] == 30
    assert ann["kvgpu.io/devices.main"] == claim["spec"]["devices"][0]["uuid"]
    table = gpu.cluster.kubectl("get", "vgpuclaims", "-n", gpu.ns).stdout
    header = table.splitlines()[0].split()
    assert header[:9] == ["NAME", "POD", "CONTAINER", "NODE", "GPU", "MEMORY", "CORES", "PHASE", "AGE"]
    row = table.splitlines()[1].split()
    # No phase is written while the pod holds the claim (Bound, derived: kubectl vgpu claims).
    assert row[1:7] == ["seed", "main", pod["spec"]["nodeName"], "0", "3000Mi", "30%"]
    assert "phase" not in claim.get("status", {}), claim
    # The kubelet would start it: the claim needs no write for that; the pod ending releases it.
    gpu.mark_running("seed")
    gpu.cluster.kubectl("patch", "pod", "seed", "-n", gpu.ns, "--subresource=status", "--type=merge",
                        "-p", json.dumps({"status": {"phase": "Succeeded"}}))
    gpu.wait(lambda: gpu.claims()[0].get("status", {}).get("phase") == "Released", what="claim Released")


def test_hami_resource_form(gpu: GpuEnv) -> None:
    gpu.nodes(1, cards=2)
    gpu.create(gpu.pod("hami", limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000",
                                        "nvidia.com/gpucores": "30"}))
    gpu.wait_bound("hami")
    [claim] = gpu.claims()
    assert claim["spec"]["devices"][0]["memory"] == 3000 and claim["spec"]["devices"][0]["cores"] == 30


def test_pods_exceeding_a_card_land_on_different_cards(gpu: GpuEnv) -> None:
    gpu.nodes(1, cards=2, memory_mib=10000)
    gpu.create(*(gpu.pod(f"p{i}", {"kvgpu.io/gpumem": "6000", "kvgpu.io/gpucores": "10"}) for i in range(2)))
    for i in range(2):
        gpu.wait_bound(f"p{i}")
    uuids = {c["spec"]["devices"][0]["uuid"] for c in gpu.claims()}
    assert len(uuids) == 2


def test_pending_pod_explains_and_is_placed_when_capacity_frees(gpu: GpuEnv) -> None:
    gpu.nodes(1, cards=1, memory_mib=10000)
    gpu.create(gpu.pod("big", {"kvgpu.io/gpumem": "8000"}))
    gpu.wait_bound("big")
    gpu.create(gpu.pod("waiting", {"kvgpu.io/gpumem": "6000"}))
    ev = gpu.wait(lambda: [e for e in gpu.events("waiting") if e.startswith("NoGPUCapacity")], what="event")
    assert "free memory" in ev[0] and "6000 MiB" in ev[0], ev[0]
    time.sleep(1.0)
    assert not gpu.get("pod", "waiting")["spec"].get("nodeName")
    t0 = time.monotonic()
    gpu.delete_pod("big")
    gpu.wait_bound("waiting", timeout=20)
    took = time.monotonic() - t0
    print(f"requeue: pending pod placed {took:.2f} s after capacity freed")
    assert took < 5.0
    # Deleting the pod released its claim.
    names = {c["spec"]["podName"] for c in gpu.claims()}
    assert names == {"waiting"}


def test_binpack_and_a_preferred_node(gpu: GpuEnv) -> None:
    """The extender's filter answers the best node by the GPU policy (binpack here: the node
    already in use), unless the pod states a soft preference, which kube-scheduler then weighs
    against our score (kvgpu.extender.choice)."""
    names = gpu.nodes(3, cards=2)
    gpu.create(gpu.pod("first", SEED))
    used = gpu.wait_bound("first")["spec"]["nodeName"]
    gpu.create(gpu.pod("second", SEED))
    assert gpu.wait_bound("second")["spec"]["nodeName"] == used
    other = next(n for n in names if n != used)
    picky = gpu.pod("picky", SEED)
    picky["spec"]["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "preference": {"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [other]}]}}]}}
    gpu.create(picky)
    assert gpu.wait_bound("picky")["spec"]["nodeName"] == other


def test_deleting_pod_releases_claim(gpu: GpuEnv) -> None:
    gpu.nodes(1, cards=1, memory_mib=10000)
    gpu.create(gpu.pod("a", {"kvgpu.io/gpumem": "10000"}))
    gpu.wait_bound("a")
    assert len(gpu.claims()) == 1
    gpu.delete_pod("a")
    gpu.wait(lambda: not gpu.claims(), what="claim removed")
    gpu.create(gpu.pod("b", {"kvgpu.io/gpumem": "10000"}))
    gpu.wait_bound("b")


def _check_no_overallocation(gpu: GpuEnv, card_mib: int, split: int) -> dict[str, int]:
    per_card: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for c in gpu.claims():
        if c.get("status", {}).get("phase") in ("Released", "Failed"):
            continue
        for d in c["spec"]["devices"]:
            acc = per_card[d["uuid"]]
            acc[0] += 1
            acc[1] += d["memory"]
            acc[2] += d["cores"]
    for uuid, (slots, mem, cores) in per_card.items():
        assert slots <= split and mem <= card_mib and cores <= 100, (uuid, slots, mem, cores)
    return {u: v[0] for u, v in per_card.items()}


def test_operator_killed_during_burst_loses_nothing(gpu: GpuEnv) -> None:
    n_pods = 200
    gpu.nodes(5, cards=4, memory_mib=20000)  # 20 cards x 10 slots = 200 slots; memory 20 x 20000
    pods = [gpu.pod(f"b{i:03d}", {"kvgpu.io/gpumem": str(1000 + 500 * (i % 3)), "kvgpu.io/gpucores": "5"})
            for i in range(n_pods)]
    creator = threading.Thread(target=lambda: gpu.cluster.kubectl(
        "create", "-f", "-", check=False, input=json.dumps({"apiVersion": "v1", "kind": "List", "items": pods})))
    creator.start()
    gpu.wait(lambda: sum(bool(p["spec"].get("nodeName")) for p in gpu.pods()) >= 20, what="first binds")
    gpu.system.kill_operator()  # SIGKILL in the middle of the burst: binds in flight are cut
    live = gpu.pods()
    print(f"operator killed with {len(live)} pods created, {sum(bool(p['spec'].get('nodeName')) for p in live)} "
          f"bound; creations are refused while the webhook is down (failurePolicy Fail)")
    creator.join()
    time.sleep(1.0)
    gpu.system.start_operator()
    # The workload's controller would retry the refused creations; so does the test.
    have = {p["metadata"]["name"] for p in gpu.pods()}
    gpu.create(*[p for p in pods if p["metadata"]["name"] not in have])
    def all_bound() -> bool:
        return all(p["spec"].get("nodeName") for p in gpu.pods())
    gpu.wait(all_bound, timeout=180, what="all pods bound")
    pods_now = {p["metadata"]["name"]: p for p in gpu.pods()}
    assert len(pods_now) == n_pods
    gpu.wait(lambda: len(gpu.claims()) == n_pods, timeout=60, what="one claim per pod")
    claims = gpu.claims()
    by_pod = collections.Counter(c["spec"]["podName"] for c in claims)
    assert all(v == 1 for v in by_pod.values()) and len(by_pod) == n_pods
    for c in claims:
        p = pods_now[c["spec"]["podName"]]
        assert c["spec"]["podUID"] == p["metadata"]["uid"]
        assert c["spec"]["node"] == p["spec"]["nodeName"]
        assert p["metadata"]["annotations"]["kvgpu.io/devices.main"] == c["spec"]["devices"][0]["uuid"]
    _check_no_overallocation(gpu, 20000, 10)
    # allocation totals reach the pool's status within pool_status_interval_s (5 s)
    gpu.wait(lambda: json.loads(gpu.cluster.kubectl("get", "vgpupool", "default", "-o", "json").stdout)
             ["status"]["slotsUsed"] >= n_pods, timeout=20, what="pool status counts the pods")
