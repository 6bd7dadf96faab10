"""Smoke tests of the real node: a real kubelet on containerd 2.2.9 joins the dev cluster, and
a pod of the local tenant image really runs."""

from __future__ import annotations

from kvgpu.devcluster.realnode import RealNode, leftovers
from realnode.conftest import RealPods


def test_node_ready_on_containerd(real_node: RealNode) -> None:
    node = real_node.node()
    assert node is not None
    info = node["status"]["nodeInfo"]
    assert info["containerRuntimeVersion"].startswith("containerd://2.2.9"), info
    assert info["kubeletVersion"].startswith("v1.36"), info
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert ready["Ready"] == "True"
    addrs = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert addrs["InternalIP"] == real_node.node_ip
    # the agent's device plugin registered with the real kubelet
    assert int(node["status"]["allocatable"].get("nvidia.com/gpu", "0")) > 0
    images = real_node.ctr("images", "ls", "-q").stdout.split()
    assert {"kvgpu.local/pause:1", "kvgpu.local/tenant:1", "kvgpu.local/tenant-nonroot:1"} <= set(images)


def test_plain_pod_runs_and_exec_works(real_pods: RealPods) -> None:
    real_pods.apply(real_pods.pod("plain"))
    pod = real_pods.wait_running("plain")
    assert pod["status"]["podIP"].startswith("10.244.")
    out = real_pods.exec("plain", "sh", "-c", "id -u; echo hi > /tmp/x && cat /tmp/x; python3 -c 'print(6*7)'")
    assert out.split() == ["0", "hi", "42"]
    # the image's CUDA client has no rpath: without the node's driver mounted (no GPU request,
    # so no device plugin), its libcuda.so.1 is not found
    out = real_pods.exec("plain", "sh", "-c", "cuprog info 2>&1; echo rc=$?", check=False)
    assert "libcuda.so.1" in out and "rc=127" in out, out
    env = real_pods.exec("plain", "env")
    assert "LD_LIBRARY_PATH=/usr/local/nvidia/lib64" in env


def test_nonroot_image_runs_as_tenant(real_pods: RealPods) -> None:
    real_pods.apply(real_pods.pod("nonroot", image="tenant-nonroot"))
    real_pods.wait_running("nonroot")
    assert real_pods.exec("nonroot", "id").split()[0] == "uid=1000(tenant)"


def test_leftover_check_sees_a_running_node(real_node: RealNode) -> None:
    # stop() raises if leftovers() is not empty afterwards; here, with the node up, it must see it
    found = leftovers(real_node._host_state())
    assert any(x.startswith("mount /var/lib/kubelet") for x in found), found
    assert any(x.startswith("process kubelet") for x in found), found
