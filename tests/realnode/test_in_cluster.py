"""The kvgpu system itself as pods on the real node, from the product images and rendered YAML.

For this module the session's host-process system (operator, kvgpu kube-scheduler) and host
agent are stopped; :func:`kvgpu.devcluster.incluster.install_on_real_node` renders
manifests/base, adapts it with explicit values (hostNetwork, API endpoint, ports, images, dev
certificates) and applies it; at the end it is uninstalled and the host-process system restarted
for the other modules. Checked: the operator's pod (uid 65532, read-only root, its child
processes), the agent's DaemonSet pod (device plugin registered with the real kubelet, the shim
installed), kube-scheduler from the ktp binary, and the seed pod (examples/deployment-seed.yaml:
1 card, 3000 MiB, 30 %) scheduled by that scheduler through the in-cluster extender, running on
the real node and seeing its slice, whose memory the agent's metrics report from the region;
and, while that pod's process maps the shim, a rebuilt shim installed beside it (the process
keeps its file and bytes).
"""

from __future__ import annotations

import json
import re
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvgpu.agent import shiminstall
from kvgpu.core import keys
from kvgpu.devcluster import incluster
from kvgpu.devcluster.images import REPO_ROOT
from kvgpu.devcluster.realnode import SHIM_SOURCE, RealNode
from kvgpu.devcluster.system import KvgpuSystem
from realnode.conftest import RealPods

MIB = 1 << 20
NS = incluster.NAMESPACE


@pytest.fixture(scope="module")
def system(real_node: RealNode, kvgpu_system: KvgpuSystem) -> Iterator[incluster.InstalledSystem]:
    real_node.stop_agent()
    kvgpu_system.stop()
    t = time.monotonic()
    installed = None
    try:
        installed = incluster.install_on_real_node(real_node)
        print(f"\n[kvgpu] in-cluster system installed and rolled out in {time.monotonic() - t:.1f} s")
        yield installed
    finally:
        if installed is not None:
            incluster.uninstall(real_node.cluster, installed.docs)
        kvgpu_system.start_operator()
        kvgpu_system.start_scheduler()
        real_node.start_agent()


def _pod_of(cluster: Any, component: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "pods", "-n", NS, "-l", f"app.kubernetes.io/component={component}",
                          "-o", "json").stdout
    [pod] = json.loads(out)["items"]
    return dict(pod)


def _exec(cluster: Any, pod: str, *cmd: str) -> str:
    return str(cluster.kubectl("exec", pod, "-n", NS, "--", *cmd).stdout)


def test_operator_pod_and_its_children(real_node: RealNode, system: incluster.InstalledSystem) -> None:
    c = real_node.cluster
    pod = _pod_of(c, "operator")
    assert pod["spec"]["nodeName"] == real_node.name and pod["spec"]["hostNetwork"] is True
    assert pod["spec"]["containers"][0]["image"] == system.values.operator_image
    name = pod["metadata"]["name"]
    assert _exec(c, name, "sh", "-c", "id -u; id -g").split() == ["65532", "65532"]
    assert _exec(c, name, "awk", '$2=="/"{print $4}', "/proc/mounts").startswith("ro")
    # the processes of the container: main + 2 admission workers + the claim-phase worker (leader)
    comms = _exec(c, name, "sh", "-c", "cat /proc/[0-9]*/comm").split()
    assert comms.count("kvgpu-webhook") == 2, comms
    assert comms.count("kvgpu-phases") == 1, comms
    # the operator answers on its metrics port (hostNetwork: the host's port)
    with urllib.request.urlopen(f"{system.operator_metrics_url}/readyz", timeout=5) as r:
        assert r.status == 200


def test_agent_daemonset_pod(real_node: RealNode, system: incluster.InstalledSystem) -> None:
    c = real_node.cluster
    pod = _pod_of(c, "agent")
    assert pod["spec"]["nodeName"] == real_node.name
    assert pod["spec"]["containers"][0]["image"] == system.values.agent_image
    mounts = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["spec"]["volumes"]}
    assert mounts["device-plugins"] == "/var/lib/kubelet/device-plugins" and mounts["shim"] == "/usr/local/kvgpu"
    # the device plugin registered with the real kubelet, the shim installed from the image
    node = json.loads(c.kubectl("get", "node", real_node.name, "-o", "json").stdout)
    assert int(node["status"]["allocatable"].get("nvidia.com/gpu", "0")) > 0
    lib = _exec(c, pod["metadata"]["name"], "readlink", "/usr/local/kvgpu/lib/libvgpu.so").strip()
    assert lib.startswith("libvgpu.so."), lib


def test_scheduler_is_the_ktp_binary(real_node: RealNode, system: incluster.InstalledSystem) -> None:
    pod = _pod_of(real_node.cluster, "scheduler")
    assert pod["spec"]["containers"][0]["image"] == system.values.scheduler_image
    assert system.values.scheduler_image.startswith("kvgpu.local/kube-scheduler:v1.")


def _seed_pod(ns: str, node: str) -> dict[str, Any]:
    """One replica of examples/deployment-seed.yaml's template, with the tenant image."""
    dep = yaml.safe_load((REPO_ROOT / "examples" / "deployment-seed.yaml").read_text())
    tpl = dep["spec"]["template"]
    [ctr] = tpl["spec"]["containers"]
    ctr.update(image="kvgpu.local/tenant:1", imagePullPolicy="Never", command=["sleep", "3600"])
    spec = {**tpl["spec"], "nodeSelector": {"kubernetes.io/hostname": node}, "terminationGracePeriodSeconds": 1}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "seed", "namespace": ns,
                                                          "annotations": tpl["metadata"]["annotations"]},
            "spec": spec}


def _metric(url: str, name_re: str, pod: str) -> float | None:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if re.match(name_re, line) and f'pod="{pod}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_seed_pod_through_the_in_cluster_scheduler(real_pods: RealPods, system: incluster.InstalledSystem) -> None:
    rp = real_pods
    rp.apply(_seed_pod(rp.ns, rp.node.name))
    pod = rp.wait_running("seed", timeout=120)
    assert pod["spec"]["schedulerName"] == "kvgpu-scheduler"  # the in-cluster webhook set it
    assert pod["spec"]["nodeName"] == rp.node.name
    events = json.loads(rp.cluster.kubectl("get", "events", "-n", rp.ns, "-o", "json",
                                           "--field-selector=involvedObject.name=seed").stdout)["items"]
    assert any(e.get("reportingComponent") == "kvgpu-scheduler" or
               e.get("source", {}).get("component") == "kvgpu-scheduler" for e in events), events
    # the extender's bind (the profile's bindVerb) made the pod's claim: the in-cluster operator's
    claims = json.loads(rp.cluster.kubectl("get", "vgpuclaims", "-n", rp.ns, "-o", "json").stdout)["items"]
    assert [(c["spec"]["podName"], c["spec"]["node"]) for c in claims] == [("seed", rp.node.name)], claims
    info = json.loads(rp.exec("seed", "sh", "-c", "cuprog info").splitlines()[0])
    assert info["rc"] == 0 and info["total"] == 3000 * MIB, info
    # memory allocated through the stub driver, held, and read by the agent from the region
    rp.exec("seed", "sh", "-c", f"(cuprog fill alloc {512 * MIB} 1 60 >/tmp/hold.json 2>&1 &) ; sleep 1")
    deadline = time.monotonic() + 30
    used = None
    while time.monotonic() < deadline:
        used = _metric(system.agent_metrics_url, r"^(kvgpu_container_memory_used_bytes|vGPU_device_memory_usage)",
                       "seed")
        if used and used >= 512 * MIB:
            break
        time.sleep(1)
    assert used is not None and used >= 512 * MIB, used
    _shim_upgrade_keeps_the_mapped_file()


def _mapping_pids(path_prefix: str) -> dict[int, str]:
    """Host PID -> the file under ``path_prefix`` it maps (from /proc/<pid>/maps; root here)."""
    out: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for line in (d / "maps").read_text().splitlines():
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(path_prefix):
                    out[int(d.name)] = parts[5]
        except OSError:
            continue
    return out


def _shim_upgrade_keeps_the_mapped_file() -> None:
    """An agent upgrade installs a rebuild of the same version (other bytes) while the seed
    pod's process maps the shim: that process keeps its file, name and bytes, the link moves."""
    lib_dir = Path(keys.HOST_SHIM_DIR)
    mapped = _mapping_pids(str(lib_dir) + "/")
    assert mapped, "no process maps the installed shim"
    pid, name = next(iter(mapped.items()))
    assert not name.endswith("(deleted)"), name
    before = shiminstall.sha256_file(Path(name))
    rebuilt = Path(tempfile.mkdtemp()) / "libvgpu.so"
    rebuilt.write_bytes(SHIM_SOURCE.read_bytes() + b"\0rebuilt")
    r = shiminstall.install_shim(rebuilt, "0.1.0", lib_dir, None)
    assert r.action == "beside" and r.switched, r
    maps = (Path("/proc") / str(pid) / "maps").read_text()
    assert name in maps and f"{name} (deleted)" not in maps
    assert shiminstall.sha256_file(Path(name)) == before
    assert (lib_dir / "libvgpu.so").resolve() == r.path
    # back to the image's build (the name it had: unchanged, the link switched back)
    back = shiminstall.install_shim(SHIM_SOURCE, "0.1.0", lib_dir, None)
    assert back.action == "unchanged" and str(back.path) == name
