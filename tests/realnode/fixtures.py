"""Real-node fixtures: one real kubelet + containerd node (kvgpu.devcluster.realnode) joined to
the session's control plane, with the kvgpu system and the node agent, started once per
session and torn down (with a leftover check) at the end. Registered by tests/conftest.py, so
tests/realnode and tests/security share the one node (a second would not get the machine lock).

Where the node cannot start (not root, containerd/runc/CNI missing, another real node holds the
machine lock) the tests skip — or fail when ``KVGPU_REQUIRE_REAL_NODE=1`` (``make test``).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.realnode import RealNode, RealNodeUnavailable
from kvgpu.devcluster.system import KvgpuSystem


def _unavailable(reason: str) -> None:
    if os.environ.get("KVGPU_REQUIRE_REAL_NODE") == "1":
        pytest.fail(f"the real node cannot start (KVGPU_REQUIRE_REAL_NODE=1): {reason}", pytrace=False)
    pytest.skip(f"no real node here: {reason}")


@pytest.fixture(scope="session")
def real_node(cluster: Cluster, kvgpu_system: KvgpuSystem) -> Iterator[RealNode]:
    node = RealNode(cluster, cards=4)  # 40 replicas: room for the 30-pod burst
    try:
        node.start()
    except RealNodeUnavailable as e:
        _unavailable(str(e))
    print(f"\n[kvgpu] real node {node.name} in {node.dir} (kubelet log {node.kubelet_log})")
    try:
        node.apply_pool()
        node.start_agent()
        yield node
    finally:
        node.stop()  # raises RealNodeError if anything is left on the host


class RealPods:
    """Pods on the real node in one test namespace."""

    def __init__(self, node: RealNode, namespace: str) -> None:
        self.node, self.cluster, self.ns = node, node.cluster, namespace

    def pod(self, name: str, image: str = "tenant", command: tuple[str, ...] = ("sleep", "3600"),
            **spec: Any) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": self.ns},
                "spec": {"nodeName": self.node.name, "terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "main", "image": self.node.image(image),
                                         "imagePullPolicy": "Never", "command": list(command)}], **spec}}

    def apply(self, obj: dict[str, Any]) -> None:
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))

    def get(self, name: str) -> dict[str, Any]:
        return dict(json.loads(self.cluster.kubectl("get", "pod", name, "-n", self.ns, "-o", "json").stdout))

    def wait_running(self, name: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        pod: dict[str, Any] = {}
        while time.monotonic() < deadline:
            pod = self.get(name)
            if pod.get("status", {}).get("phase") == "Running":
                return pod
            time.sleep(0.3)
        events = self.cluster.kubectl("get", "events", "-n", self.ns, "-o", "json",
                                      f"--field-selector=involvedObject.name={name}").stdout
        msgs = [f"{e['reason']}: {e['message']}" for e in json.loads(events)["items"]]
        raise AssertionError(f"pod {name} not Running after {timeout} s: {pod.get('status')}; events {msgs}")

    def exec(self, name: str, *cmd: str, check: bool = True) -> str:
        return self.cluster.kubectl("exec", name, "-n", self.ns, "--", *cmd, check=check).stdout


@pytest.fixture
def real_pods(real_node: RealNode) -> Iterator[RealPods]:
    ns = f"rn-{uuid.uuid4().hex[:10]}"
    real_node.cluster.kubectl("create", "namespace", ns)
    yield RealPods(real_node, ns)
    # A real kubelet finishes these: delete with a short grace, not --force, and wait, so the next
    # test finds the node's cards as free as this one did.
    real_node.cluster.kubectl("delete", "pods", "--all", "-n", ns, "--wait=true", "--timeout=120s", check=False)
    real_node.cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
