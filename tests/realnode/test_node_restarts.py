"""Restarts on the real node: the kubelet and the node agent come and go, running GPU pods stay
as they are, the device plugin is registered again, and capacity never drops to zero devices."""

from __future__ import annotations

import json
import re
from typing import Any

from realnode.conftest import RealPods
from realnode.gpupods import card_nodes, exec_in, gpu_pod, hami_limits, minors, uuids_of, wait_for

MIB = 1 << 20


def _container(pod: dict[str, Any]) -> tuple[str, int]:
    st = pod["status"]["containerStatuses"][0]
    return st["containerID"], st["restartCount"]


def _capacity(rp: RealPods) -> int:
    node = rp.node.node() or {}
    return int(node.get("status", {}).get("allocatable", {}).get("nvidia.com/gpu", "0") or 0)


def _pushed_capacities(log_text: str) -> list[int]:
    """Every ``resourceCapacity`` the kubelet logged for the plugin's resource (``--v=2``)."""
    pat = re.compile(r'"State pushed for device plugin" resource="nvidia\.com/gpu" resourceCapacity=(\d+)')
    return [int(m.group(1)) for m in pat.finditer(log_text)]


def _new_pod_gets_its_card(rp: RealPods, name: str) -> None:
    rp.apply(gpu_pod(rp, name, limits=hami_limits(1, 1000)))
    pod = rp.wait_running(name, timeout=90)
    assert card_nodes(rp, name) == minors(rp, uuids_of(pod, "main"))


def test_kubelet_restart_reregisters_the_plugin_and_leaves_pods_running(real_pods: RealPods) -> None:
    node = real_pods.node
    full = _capacity(real_pods)
    real_pods.apply(gpu_pod(real_pods, "before", limits=hami_limits(1, 2000)))
    before = _container(real_pods.wait_running("before"))
    agent_log = node.agent_log.read_text(errors="replace")
    node.restart_kubelet()
    wait_for(lambda: _capacity(real_pods) == full, 60, f"nvidia.com/gpu back to {full} after the restart")
    wait_for(lambda: node.agent_log.read_text(errors="replace").count("registered nvidia.com/gpu")
             > agent_log.count("registered nvidia.com/gpu"), 30, "the agent registering again")
    pod = real_pods.get("before")
    assert pod["status"]["phase"] == "Running"
    assert _container(pod) == before  # the same container, not restarted
    # the restarted kubelet answers exec once it has synced its pods again ("pod does not exist" before)
    wait_for(lambda: real_pods.cluster.kubectl("exec", "before", "-n", real_pods.ns, "--", "true",
                                               check=False).returncode == 0, 30, "exec through the new kubelet")
    info = json.loads(exec_in(real_pods, "before", "main", "cuprog info").splitlines()[0])
    assert info["total"] == 2000 * MIB  # still under its claim
    _new_pod_gets_its_card(real_pods, "after")


def test_agent_restart_never_offers_zero_devices_and_leaves_pods_running(real_pods: RealPods) -> None:
    node = real_pods.node
    full = _capacity(real_pods)
    real_pods.apply(gpu_pod(real_pods, "before", limits=hami_limits(1, 1000)))
    before = _container(real_pods.wait_running("before"))
    offset = node.kubelet_log.stat().st_size
    node.restart_agent()
    wait_for(lambda: _capacity(real_pods) == full, 60, f"nvidia.com/gpu back to {full}")

    def pushed() -> list[int]:
        with node.kubelet_log.open(errors="replace") as f:
            f.seek(offset)
            return _pushed_capacities(f.read())

    caps = wait_for(pushed, 30, "the kubelet's record of the new plugin's devices")
    assert 0 not in caps, f"the new plugin offered no devices for a while: {caps}"
    assert caps[-1] == full
    assert _container(real_pods.get("before")) == before
    _new_pod_gets_its_card(real_pods, "after")
