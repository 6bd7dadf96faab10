"""Shared fixtures.

``cluster`` (session): one real local control plane per test session — etcd, kube-apiserver,
kube-controller-manager and a default kube-scheduler from hack/ktp — started on first use,
stopped by PID at the end. Unit tests never touch it. ``namespace``: a fresh namespace per test.

Set ``KVGPU_TEST_RUN_DIR`` to keep the run directory (PKI, kubeconfig, component logs) at a
known place for debugging; by default it is a pytest tmp dir, printed at start-up.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.system import KvgpuSystem
from realnode.fixtures import real_node, real_pods

__all__ = ["real_node", "real_pods"]  # the session's real node, for tests/realnode and tests/security


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    run_dir = Path(os.environ.get("KVGPU_TEST_RUN_DIR") or tmp_path_factory.mktemp("kvgpu-cluster"))
    c = Cluster(run_dir=run_dir)
    print(f"\n[kvgpu] local control plane in {run_dir} (logs in {run_dir / 'logs'})")
    c.start()
    out = c.kubectl("version", "-o", "json").stdout
    _SUMMARY.append(f"kube-apiserver answered: {json.loads(out)['serverVersion']['gitVersion']} "
                    f"(real control plane from hack/ktp, run dir {run_dir})")
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def kvgpu_system(cluster: Cluster) -> Iterator[KvgpuSystem]:
    """The whole kvgpu system (CRDs, the operator process, the kvgpu kube-scheduler) on the
    session's control plane; shared by tests/cluster and tests/realnode."""
    system = KvgpuSystem(cluster).start()
    try:
        yield system
    finally:
        system.stop()


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    # Pods on fake nodes have no kubelet to finish them: delete them at once, then the namespace.
    cluster.kubectl("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force", "--wait=false",
                    check=False)
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


_SUMMARY: list[str] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _SUMMARY:
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests under tests/cluster are cluster tests even if a module forgets the marker.
    for item in items:
        path = str(item.fspath).replace(os.sep, "/")
        if "tests/cluster/" in path:
            item.add_marker(pytest.mark.cluster)
        if "tests/realnode/" in path:
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.realnode)
