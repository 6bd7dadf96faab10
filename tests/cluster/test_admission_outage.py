"""With the operator down, the webhooks fail closed for GPU pods only: ``failurePolicy: Fail``
refuses pods that ask for slices (HAMi's ``Ignore`` would let them run unlimited on the default
scheduler), while the match conditions keep every other pod and workload working."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from clusterkit import free_port, temporarily_applied
from kvgpu.admission.config import webhook_configurations
from kvgpu.devcluster import Cluster


@pytest.fixture
def dead_webhooks(cluster: Cluster) -> Iterator[None]:
    # Nothing listens at this port: every call to the webhook fails.
    configs = webhook_configurations(
        url_base=f"https://127.0.0.1:{free_port()}", service=None,
        ca_bundle=(cluster.run_dir / "pki" / "ca.crt").read_bytes(), exclude_namespaces=[],
    )
    with temporarily_applied(cluster, list(configs)):
        yield


def _pod(namespace: str, name: str, annotations: dict[str, str]) -> str:
    return json.dumps({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
        "spec": {"containers": [{"name": "main", "image": "registry.invalid/app"}]},
    })


def test_operator_down_refuses_gpu_pods_only(cluster: Cluster, namespace: str, dead_webhooks: None) -> None:
    deadline = time.monotonic() + 30
    while True:  # the API server loads new configurations asynchronously
        p = cluster.kubectl("create", "--dry-run=server", "-f", "-", check=False,
                            input=_pod(namespace, "gpu", {"kvgpu.io/gpumem": "3000"}))
        if p.returncode != 0 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert p.returncode != 0, "a GPU pod was admitted with the webhook down"
    assert "pods.mutate.kvgpu.io" in p.stderr and "failed calling webhook" in p.stderr, p.stderr
    cluster.kubectl("create", "-f", "-", input=_pod(namespace, "web", {"team": "web"}))
    cluster.kubectl("label", "pod", "web", "-n", namespace, "tier=front")
    cluster.kubectl("create", "deployment", "web", "-n", namespace, "--image=registry.invalid/app")
    cluster.kubectl("delete", "pod", "web", "-n", namespace, "--wait=false")
