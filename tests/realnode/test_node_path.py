"""The node path on a real kubelet + containerd: what a kvgpu container really gets.

Every test places its pods through the whole system (webhooks, kvgpu-scheduler and the
extender, VGPUClaims, the real kubelet calling the agent's device plugin, runc) and asserts from
inside the container: env and files, device nodes, mounts, the shim in a dynamic process, the
CUDA program (the simulated node's driver is the stub libcuda/libnvidia-ml the device plugin
mounts from the node's driver folder) and claim phases written from real container states.
"""

from __future__ import annotations

import json
import re

from kvgpu.core import keys
from realnode.conftest import RealPods
from realnode.gpupods import (
    apply_all,
    card_nodes,
    claim_of,
    claims,
    container,
    events,
    exec_in,
    gpu_pod,
    hami_limits,
    minors,
    mount_targets,
    uuids_of,
    wait_all_running,
    wait_for,
)

MIB = 1 << 20
NVML_VIEW = ("import pynvml as n; n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0); "
             "m = n.nvmlDeviceGetMemoryInfo(h); print(f'{m.used >> 20}MiB / {m.total >> 20}MiB')")


def _run_one(rp: RealPods, name: str = "gpu", **kw: object) -> dict:
    rp.apply(gpu_pod(rp, name, **kw))  # type: ignore[arg-type]
    return rp.wait_running(name, timeout=90)


def test_hami_pod_gets_claim_env_and_claim_file(real_pods: RealPods) -> None:
    pod = _run_one(real_pods, limits=hami_limits(1, 3000, 30))
    claim, uuids = claim_of(pod, "main"), uuids_of(pod, "main")
    assert re.fullmatch(rf"v1;claim={real_pods.ns}/[^;]+;priority=1;dev={uuids[0]},3000,30", claim), claim
    env = dict(ln.split("=", 1) for ln in exec_in(real_pods, "gpu", "main", "env").splitlines() if "=" in ln)
    assert env[keys.ENV_CLAIM] == claim
    assert env[keys.ENV_VISIBLE] == uuids[0]
    assert env[keys.ENV_POD_UID] == pod["metadata"]["uid"]
    assert exec_in(real_pods, "gpu", "main", f'cat "${keys.ENV_CLAIM_FILE}"') == claim
    assert "LD_PRELOAD" not in env  # the shim comes from /etc/ld.so.preload, not the environment


def test_claims_follow_the_kubelet(real_pods: RealPods) -> None:
    # Held (no phase written: Bound) while the container runs; Released when it exited.
    real_pods.apply(gpu_pod(real_pods, "short", restartPolicy="Never", containers=[
        container("main", hami_limits(1, 1000), command=("sh", "-c", "sleep 4"))]))
    real_pods.wait_running("short")
    assert [c for c in claims(real_pods) if not c.get("status", {}).get("phase")], claims(real_pods)
    wait_for(lambda: real_pods.get("short")["status"].get("phase") == "Succeeded", 60, "the pod Succeeded")
    wait_for(lambda: all(c.get("status", {}).get("phase") == "Released" for c in claims(real_pods)), 30,
             "the claim Released")


def test_shim_loaded_by_ld_so_preload_in_a_dynamic_program(real_pods: RealPods) -> None:
    _run_one(real_pods, limits=hami_limits(1, 1000))
    assert exec_in(real_pods, "gpu", "main", "cat /etc/ld.so.preload").strip() == keys.CONTAINER_SHIM_LIB
    maps = exec_in(real_pods, "gpu", "main", "python3 -c \"print(open('/proc/self/maps').read())\"")
    assert f"{keys.CONTAINER_SHIM_DIR}/libvgpu.so" in maps
    # busybox is static: no loader, no shim, and it still runs
    assert "libvgpu" not in exec_in(real_pods, "gpu", "main", "cat /proc/self/maps")


def test_cuda_program_and_nvml_see_the_slice(real_pods: RealPods) -> None:
    _run_one(real_pods, limits=hami_limits(1, 3000, 30))
    info = json.loads(exec_in(real_pods, "gpu", "main", "cuprog info").splitlines()[0])
    assert info["rc"] == 0 and info["total"] == 3000 * MIB, info
    assert exec_in(real_pods, "gpu", "main", f'python3 -c "{NVML_VIEW}"').strip() == "0MiB / 3000MiB"
    fill = json.loads(exec_in(real_pods, "gpu", "main", f"cuprog fill alloc {256 * MIB}").splitlines()[0])
    assert fill["rc"] == 2, fill  # CUDA_ERROR_OUT_OF_MEMORY at the limit
    assert 2000 * MIB <= fill["bytes"] <= 3000 * MIB, fill


def test_region_shared_by_two_processes_of_a_container(real_pods: RealPods) -> None:
    _run_one(real_pods, limits=hami_limits(1, 3000))
    out = exec_in(real_pods, "gpu", "main",
                  f"cuprog fill alloc {1024 * MIB} 2 6 >/tmp/holder.json & sleep 2; cuprog info; "
                  f"cuprog fill alloc {1024 * MIB}; ls -l $KVGPU_REGION_DIR; wait")
    lines = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    info, fill = lines[0], lines[1]
    assert info["free"] <= 1000 * MIB + 1, info  # the other process's 2 GiB count against this one
    assert fill["n"] == 0 and fill["rc"] == 2, fill
    assert "vgpu.region" in out
    assert json.loads(exec_in(real_pods, "gpu", "main", "cat /tmp/holder.json").splitlines()[0])["n"] == 2


def test_init_gpu_and_plain_containers_each_get_their_own(real_pods: RealPods) -> None:
    init = [container("prep", hami_limits(1, 1000), command=("sh", "-c", 'echo "$KVGPU_CLAIM" > /shared/init'))]
    ctrs = [container("main", hami_limits(1, 2000)), container("side")]
    vol = [{"name": "shared", "emptyDir": {}}]
    for c in (*init, *ctrs):
        c["volumeMounts"] = [{"name": "shared", "mountPath": "/shared"}]
    real_pods.apply(gpu_pod(real_pods, "multi", init=init, containers=ctrs, volumes=vol))
    pod = real_pods.wait_running("multi", timeout=90)
    assert exec_in(real_pods, "multi", "main", "cat /shared/init").strip() == claim_of(pod, "prep")
    assert claim_of(pod, "prep").endswith(",1000,0") and claim_of(pod, "main").endswith(",2000,0")
    assert claim_of(pod, "prep") != claim_of(pod, "main")
    assert card_nodes(real_pods, "multi", "main") == minors(real_pods, uuids_of(pod, "main"))
    side = exec_in(real_pods, "multi", "side", "env; ls /dev")
    assert f"{keys.ENV_VISIBLE}=none" in side and keys.ENV_CLAIM + "=" not in side
    assert card_nodes(real_pods, "multi", "side") == set()
    by_ctr = {c["spec"]["container"]: c for c in claims(real_pods)}
    assert set(by_ctr) == {"prep", "main"} and by_ctr["prep"]["spec"]["init"] is True


def test_two_card_pod_gets_both_cards(real_pods: RealPods) -> None:
    pod = _run_one(real_pods, limits=hami_limits(2, 1000))
    uuids = uuids_of(pod, "main")
    assert len(set(uuids)) == 2
    assert card_nodes(real_pods, "gpu") == minors(real_pods, uuids)
    for ordinal in (0, 1):
        info = json.loads(exec_in(real_pods, "gpu", "main", f"cuprog info {ordinal}").splitlines()[0])
        assert info["rc"] == 0 and info["total"] == 1000 * MIB, info


def test_device_nodes_and_driver_files_come_from_the_claim(real_pods: RealPods) -> None:
    pod = _run_one(real_pods, limits=hami_limits(1, 1000))
    out = exec_in(real_pods, "gpu", "main", "ls /dev /usr/local/nvidia/lib64; echo LD=$LD_LIBRARY_PATH")
    assert {"nvidiactl", "nvidia-uvm", "libcuda.so.1", "libnvidia-ml.so.1"} <= set(out.split())
    assert "LD=/usr/local/nvidia/lib64" in out
    assert card_nodes(real_pods, "gpu") == minors(real_pods, uuids_of(pod, "main"))  # no other card's node


def test_pod_deletion_deletes_its_claims(real_pods: RealPods) -> None:
    _run_one(real_pods, limits=hami_limits(1, 1000))
    assert len(claims(real_pods)) == 1
    real_pods.cluster.kubectl("delete", "pod", "gpu", "-n", real_pods.ns, "--wait=true", "--timeout=60s")
    wait_for(lambda: claims(real_pods) == [], 30, "the claim deleted with its pod")


def test_annotation_and_hami_forms_get_the_same_devices_and_mounts(real_pods: RealPods) -> None:
    ann = {"kvgpu.io/gpu": "1", "kvgpu.io/gpumem": "1000"}
    apply_all(real_pods, [gpu_pod(real_pods, "ann", annotations=ann),
                          gpu_pod(real_pods, "hami", limits=hami_limits(1, 1000))])
    pods = wait_all_running(real_pods, ["ann", "hami"], timeout=90)
    shapes = {}
    for name in ("ann", "hami"):
        targets = mount_targets(real_pods, name)
        dup = sorted({t for t in targets if targets.count(t) > 1})
        assert not dup, f"{name}: mounted more than once: {dup}"
        assert card_nodes(real_pods, name) == minors(real_pods, uuids_of(pods[name], "main"))
        shapes[name] = sorted(re.sub(r"nvidia\d+$", "nvidiaN", t) for t in targets)
    assert shapes["ann"] == shapes["hami"]
    assert keys.CONTAINER_SHIM_DIR in shapes["ann"] and "/etc/ld.so.preload" in shapes["ann"]
    # the device plugin's mounts: the container's region and the schedule (no hostPath in the pod)
    assert not any("hostPath" in v for p in pods.values() for v in p["spec"].get("volumes", []))
    assert {keys.CONTAINER_REGION_DIR, keys.CONTAINER_SCHED_DIR} <= set(shapes["ann"]), shapes["ann"]


def test_burst_of_hami_pods_each_container_uses_its_claims_card(real_pods: RealPods) -> None:
    names = [f"b{i:02d}" for i in range(30)]
    apply_all(real_pods, [gpu_pod(real_pods, n, limits=hami_limits(1, 1000)) for n in names])
    pods = wait_all_running(real_pods, names, timeout=240)
    wrong = {}
    for n in names:
        want = minors(real_pods, uuids_of(pods[n], "main"))
        got = card_nodes(real_pods, n)
        if got != want:
            wrong[n] = (got, want)
    assert not wrong, f"containers whose device node is not their claim's card: {wrong}"
    # the kubelet's own record (what PodResources and DCGM report) names the claimed cards too
    ckpt = json.loads(real_pods.node.kubelet_checkpoint())
    uid_to_pod = {p["metadata"]["uid"]: p for p in pods.values()}
    seen = 0
    for e in ckpt["Data"]["PodDeviceEntries"]:
        pod = uid_to_pod.get(e["PodUID"])
        if pod is None or e["ResourceName"] != "nvidia.com/gpu":
            continue
        ids = [i for per_numa in e["DeviceIDs"].values() for i in per_numa]
        assert {i.split("::")[0] for i in ids} == set(uuids_of(pod, e["ContainerName"])), e
        seen += 1
    assert seen == len(names)


def test_scheduler_event_reads_correctly(real_pods: RealPods) -> None:
    cards = real_pods.node.cards
    apply_all(real_pods, [gpu_pod(real_pods, f"big{i}", limits=hami_limits(1, 1000, 80)) for i in range(cards)])
    wait_all_running(real_pods, [f"big{i}" for i in range(cards)])
    real_pods.apply(gpu_pod(real_pods, "nofit", limits=hami_limits(1, 1000, 30)))

    def failed() -> list[str]:
        return [e["message"] for e in events(real_pods, "nofit") if e["reason"] == "FailedScheduling"]

    msgs = wait_for(failed, 60, "a FailedScheduling event")
    assert all("%!" not in m and "MISSING" not in m for m in msgs), msgs
    assert any("percent" in m for m in msgs), msgs
