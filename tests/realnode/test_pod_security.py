"""GPU pods in PodSecurity ``baseline`` and ``restricted`` namespaces on the real node.

The webhook injects no hostPath: the shim, ``/etc/ld.so.preload``, the container's own region
directory and the compute schedule come from the device plugin's ``Allocate``, which the real
kubelet applies and PodSecurity (a default admission plugin of the real kube-apiserver) never
sees. Each test first shows the namespace's level is enforced (a hostPath pod is refused), then
runs a GPU pod there and checks from inside it what it got: the claim (env and file), the shim
loaded by ``ld.so.preload`` in a dynamic process, the CUDA program's total = the limit, and the
region the shim writes in its own directory, read on the host with the agent's reader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvgpu.agent.usage import default_reader
from kvgpu.core import keys
from realnode.conftest import RealPods
from realnode.gpupods import claim_of, container, exec_in, gpu_pod, hami_limits, wait_for

MIB = 1 << 20
PSA = "pod-security.kubernetes.io/enforce"
RESTRICTED_SC = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "allowPrivilegeEscalation": False,
                 "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
MAPS = "python3 -c \"print(open('/proc/self/maps').read())\""


def _enforce(rp: RealPods, level: str) -> None:
    """Label the test namespace and show the level is enforced: a hostPath pod is refused."""
    rp.cluster.kubectl("label", "namespace", rp.ns, f"{PSA}={level}")
    probe = rp.pod("hostpath-probe", volumes=[{"name": "h", "hostPath": {"path": "/srv"}}])
    if level == "restricted":
        probe["spec"]["containers"][0]["securityContext"] = RESTRICTED_SC
    p = rp.cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False)
    assert p.returncode != 0 and f'violates PodSecurity "{level}:latest"' in p.stderr and "hostPath" in p.stderr, \
        p.stderr


def _holder(name: str, mem_mib: int, hold_mib: int, sc: dict[str, Any] | None = None) -> dict[str, Any]:
    """A GPU container whose main process holds ``hold_mib`` on its card (the region has usage)."""
    c = container(name, hami_limits(1, mem_mib), command=("cuprog", "fill", "alloc", str(hold_mib * MIB), "1", "600"))
    if sc is not None:
        c["securityContext"] = sc
    return c


def _host_region(pod: dict[str, Any], ctr: str) -> Path:
    return Path(keys.HOST_REGION_ROOT) / pod["metadata"]["uid"] / ctr


def _region_mount_root(rp: RealPods, pod: str, ctr: str) -> str:
    """The host-side root of the container's region mount (mountinfo field 4)."""
    lines = [ln.split() for ln in exec_in(rp, pod, ctr, "cat /proc/self/mountinfo").splitlines()]
    roots = [f[3] for f in lines if f[4] in (keys.CONTAINER_REGION_DIR, "/run/kvgpu")]
    assert len(roots) == 1, roots
    return roots[0]


def _sees_its_slice(rp: RealPods, pod: dict[str, Any], ctr: str, mem_mib: int, hold_mib: int) -> None:
    name = pod["metadata"]["name"]
    claim = claim_of(pod, ctr)
    env = dict(ln.split("=", 1) for ln in exec_in(rp, name, ctr, "env").splitlines() if "=" in ln)
    assert env[keys.ENV_CLAIM] == claim
    assert exec_in(rp, name, ctr, f"cat {keys.CONTAINER_CLAIM_FILE}") == claim
    assert exec_in(rp, name, ctr, "cat /etc/ld.so.preload").strip() == keys.CONTAINER_SHIM_LIB
    assert f"{keys.CONTAINER_SHIM_DIR}/libvgpu.so" in exec_in(rp, name, ctr, MAPS)
    info = json.loads(exec_in(rp, name, ctr, "cuprog info").splitlines()[0])
    assert info["rc"] == 0 and info["total"] == mem_mib * MIB, info
    assert info["free"] <= (mem_mib - hold_mib) * MIB + MIB, info  # the holder's memory counts
    # The shim wrote the region in the container's own directory; the agent's reader reads it.
    assert "vgpu.region" in exec_in(rp, name, ctr, f"ls {keys.CONTAINER_REGION_DIR}")
    rows = wait_for(lambda: default_reader()(_host_region(pod, ctr)), 20, f"{name}/{ctr}'s region")
    assert [r.limit_mib for r in rows] == [mem_mib], rows
    assert rows[0].used_mib >= hold_mib, rows
    assert _region_mount_root(rp, name, ctr).endswith(f"/{pod['metadata']['uid']}/{ctr}")


def test_gpu_pod_runs_in_a_baseline_namespace(real_pods: RealPods) -> None:
    _enforce(real_pods, "baseline")
    real_pods.apply(gpu_pod(real_pods, "gpu", containers=[_holder("main", 1000, 256)]))
    pod = real_pods.wait_running("gpu", timeout=90)
    assert not any("hostPath" in v for v in pod["spec"].get("volumes", []))
    _sees_its_slice(real_pods, pod, "main", 1000, 256)


def test_compliant_gpu_pod_runs_in_a_restricted_namespace(real_pods: RealPods) -> None:
    _enforce(real_pods, "restricted")
    plain = gpu_pod(real_pods, "root", limits=hami_limits(1, 500))
    p = real_pods.cluster.kubectl("create", "-f", "-", input=json.dumps(plain), check=False)
    assert p.returncode != 0 and 'violates PodSecurity "restricted:latest"' in p.stderr, p.stderr
    real_pods.apply(gpu_pod(real_pods, "gpu", containers=[_holder("main", 1000, 256, RESTRICTED_SC),
                                                          _holder("side", 600, 128, RESTRICTED_SC)]))
    pod = real_pods.wait_running("gpu", timeout=90)
    assert exec_in(real_pods, "gpu", "main", "id -u").strip() == "1000"
    _sees_its_slice(real_pods, pod, "main", 1000, 256)
    _sees_its_slice(real_pods, pod, "side", 600, 128)


def test_a_tenant_sees_no_other_containers_region(real_pods: RealPods) -> None:
    """Two GPU containers of one pod and one of another (baseline namespace): each mounts only its
    own region directory; the other's region file is nowhere in it, and its writes stay its own."""
    _enforce(real_pods, "baseline")
    real_pods.apply(gpu_pod(real_pods, "a", containers=[_holder("main", 1000, 256), _holder("side", 600, 128)]))
    real_pods.apply(gpu_pod(real_pods, "b", containers=[_holder("main", 800, 64)]))
    a, b = real_pods.wait_running("a", timeout=90), real_pods.wait_running("b", timeout=90)
    mine = {(a["metadata"]["uid"], "main"), (a["metadata"]["uid"], "side"), (b["metadata"]["uid"], "main")}
    for pod, ctr in (("a", "main"), ("a", "side"), ("b", "main")):
        uid = (a if pod == "a" else b)["metadata"]["uid"]
        assert _region_mount_root(real_pods, pod, ctr).endswith(f"/{uid}/{ctr}")
        listing = exec_in(real_pods, pod, ctr, f"ls -a {keys.CONTAINER_REGION_DIR}").split()
        others = {u for u, c in mine if (u, c) != (uid, ctr)}
        assert not others & set(listing) and "main" not in listing and "side" not in listing, listing
        # No mount of the region root, nor of a sibling's directory, anywhere in the container.
        roots = [ln.split()[3] for ln in exec_in(real_pods, pod, ctr, "cat /proc/self/mountinfo").splitlines()
                 if "kvgpu/containers" in ln.split()[3]]
        assert len(roots) == 1 and roots[0].endswith(f"/{uid}/{ctr}"), roots
    limits = {(u, c): [r.limit_mib for r in default_reader()(Path(keys.HOST_REGION_ROOT) / u / c) or []]
              for u, c in mine}
    assert limits == {(a["metadata"]["uid"], "main"): [1000], (a["metadata"]["uid"], "side"): [600],
                      (b["metadata"]["uid"], "main"): [800]}, limits
