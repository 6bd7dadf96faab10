"""MIG in extender mode on the real node (a real kubelet + containerd + runc): an H200 in MIG mode is
added live to the node's simulated inventory (its ``sim.json``, re-read by the agent on every
refresh, and fake device nodes for the card and its instances' ``nvidia-caps``); the real kubelet
registers ``nvidia.com/mig-1g.18gb`` from the agent's plugin, admits a pod asking for it, and runc
gives the container its instance and nothing of the other. A simulated card: no real MIG card is
used (the lent H200's MIG settings must not change), so no CUDA runs here."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kvgpu.core.inventory import Card, parse_simulated
from kvgpu.devcluster.realhost import NVIDIA_MAJOR
from kvgpu.devcluster.realnode import RealNode
from realnode.conftest import RealPods

MIG = "nvidia.com/mig-1g.18gb"


def _allocatable(node: RealNode, resource: str) -> str:
    n = node.node() or {}
    return str((n.get("status") or {}).get("allocatable", {}).get(resource, "0"))


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def mig_card(real_node: RealNode) -> Iterator[Card]:
    """A fifth card, in MIG mode with two 1g.18gb instances, on the real node; removed after."""
    before = real_node.sim_file.read_text()
    sim = json.loads(before)
    cards = sim["nodes"][0]["cards"]
    cards.append({"model": "NVIDIA H200", "numa": 0, "migInstances": [{"profile": "1g.18gb", "count": 2}]})
    card = parse_simulated(sim)[0].inventory().cards[-1]
    dev = real_node.dev_root
    made = [dev / f"nvidia{card.index}"]
    made += [dev / "nvidia-caps" / f"nvidia-cap{m}"
             for i in card.mig_instances for m in (i.gi_cap_minor, i.ci_cap_minor)]
    (dev / "nvidia-caps").mkdir(exist_ok=True)
    for k, p in enumerate(made):  # char devices like the driver's; the numbers need only exist
        os.mknod(p, 0o666 | 0o020000, os.makedev(NVIDIA_MAJOR, 200 + k))
        os.chmod(p, 0o666)
    real_node.sim_file.write_text(json.dumps(sim, indent=2))
    try:
        yield card
    finally:
        real_node.sim_file.write_text(before)
        for p in made:
            p.unlink(missing_ok=True)
        (dev / "nvidia-caps").rmdir()
        _wait(lambda: _allocatable(real_node, MIG) == "0", 60, f"{MIG} back to 0")


def test_a_mig_instance_reaches_its_container_alone(real_node: RealNode, real_pods: RealPods, mig_card: Card) -> None:
    _wait(lambda: _allocatable(real_node, MIG) == "2", 90, f"the kubelet's allocatable {MIG} = 2")
    pod = real_pods.pod("mig")
    pod["spec"]["containers"][0]["resources"] = {"limits": {MIG: "1"}}
    real_pods.apply(pod)
    real_pods.wait_running("mig")
    out = real_pods.exec("mig", "sh", "-c", "echo $NVIDIA_VISIBLE_DEVICES; ls /dev; echo --; ls /dev/nvidia-caps; "
                                            "echo --; cat /etc/ld.so.preload 2>/dev/null | wc -c").split("--")
    visible, *devs = out[0].split()
    caps = out[1].split()
    preload = out[2].strip()
    (mine,) = [i for i in mig_card.mig_instances if i.uuid == visible]
    (other,) = [i for i in mig_card.mig_instances if i.uuid != visible]
    assert f"nvidia{mig_card.index}" in devs and "nvidia0" not in devs, devs  # the parent only
    assert sorted(caps) == sorted([f"nvidia-cap{mine.gi_cap_minor}", f"nvidia-cap{mine.ci_cap_minor}"]), caps
    assert f"nvidia-cap{other.gi_cap_minor}" not in caps
    assert preload == "0"  # no shim: the instance is isolated in hardware
    assert _allocatable(real_node, "nvidia.com/gpu") == "40"  # the MIG card adds no shim slices
