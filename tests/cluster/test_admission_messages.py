"""Silent no-GPU cases, on the real kube-apiserver through kubectl (issue 22, messages): each is
refused naming the right key, or admitted with an admission warning that kubectl prints as
``Warning: ...``. kvgpu's admission server runs in a thread with a pool view listing the
cluster's VGPUPools, as each webhook worker does."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clusterkit import free_port, temporarily_applied, wait_port
from kvgpu.admission.config import webhook_configurations
from kvgpu.admission.server import PoolView, serve
from kvgpu.api.pools import SliceMinimum
from kvgpu.devcluster import Cluster

OPERATOR_USER = "kvgpu-operator"
NO_NODE = {"kvgpu.io/admission-test": "no-such-node"}
CRDS = Path(__file__).resolve().parents[2] / "charts" / "kvgpu" / "crds"
POOL = "msg-test-min-slice"


@pytest.fixture(scope="module")
def webhooks(cluster: Cluster) -> Iterator[PoolView]:
    cluster.kubectl("apply", "-f", str(CRDS / "kvgpu.io_vgpupools.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/vgpupools.kvgpu.io", "--timeout=30s")
    pki = cluster.run_dir / "pki"
    port = free_port()
    pools = PoolView()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(serve("127.0.0.1", port, str(pki / "webhook.crt"), str(pki / "webhook.key"),
                                      {OPERATOR_USER}, stop=stop, pools=pools,
                                      kubeconfig=str(cluster.kubeconfig)))

    t = threading.Thread(target=run, name="admission-messages", daemon=True)
    t.start()
    wait_port("127.0.0.1", port)
    configs = webhook_configurations(url_base=f"https://127.0.0.1:{port}", service=None,
                                     ca_bundle=(pki / "ca.crt").read_bytes(), exclude_namespaces=[])
    try:
        with temporarily_applied(cluster, list(configs)):
            _wait_active(cluster)
            yield pools
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(10)


def _wait_active(cluster: Cluster, timeout: float = 30.0) -> None:
    probe = _pod("default", "kvgpu-msg-probe", {"kvgpu.io/gpumem": "not-a-size"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False)
        if p.returncode != 0 and "not-a-size" in p.stderr:
            return
        time.sleep(0.3)
    raise TimeoutError(f"the kvgpu webhooks never refused the probe pod: {p.stderr or p.stdout}")


def _pod(namespace: str, name: str, annotations: dict[str, str] | None = None,
         limits: dict[str, str] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "main", "image": "registry.invalid/cuda:12"}
    if limits:
        c["resources"] = {"limits": limits}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
            "spec": {"containers": [c], "nodeSelector": NO_NODE}}


def _create(cluster: Cluster, obj: dict[str, Any]) -> Any:
    return cluster.kubectl("create", "-f", "-", input=json.dumps(obj), check=False)


def _refused(p: Any, *words: str) -> None:
    assert p.returncode != 0, p.stdout
    for w in words:
        assert w in p.stderr, p.stderr


def _warnings(p: Any) -> list[str]:
    assert p.returncode == 0, p.stderr
    return [line for line in p.stderr.splitlines() if line.startswith("Warning:")]


@pytest.mark.parametrize("key", ["kvgpu.io/GPUMEM", "Kvgpu.io/gpumem", "KVGPU.IO/gpumem", "kvgpu.io/GpuMem"])
def test_case_variants_are_refused_naming_the_key(
    cluster: Cluster, namespace: str, webhooks: PoolView, key: str,
) -> None:
    p = _create(cluster, _pod(namespace, "case", {key: "3000"}))
    _refused(p, key, "case-sensitive", "use kvgpu.io/gpumem")


@pytest.mark.parametrize(("key", "right"), [
    # Each admitted silently or with a wrong suggestion before; the unit tests list more.
    ("kvgpu.io/gpu-count", "kvgpu.io/gpu"), ("kvgpu.io/gpu-number", "kvgpu.io/gpu"),
    ("kvgpu.io/cards", "kvgpu.io/gpu"), ("kvgpu.io/vram", "kvgpu.io/gpumem"),
])
def test_misspelt_keys_get_the_right_suggestion(
    cluster: Cluster, namespace: str, webhooks: PoolView, key: str, right: str,
) -> None:
    p = _create(cluster, _pod(namespace, "typo", {key: "2"}))
    _refused(p, key, f"did you mean {right}?")


def test_unknown_kvgpu_keys_are_admitted_with_a_warning(cluster: Cluster, namespace: str,
                                                        webhooks: PoolView) -> None:
    p = _create(cluster, _pod(namespace, "unknown", {"kvgpu.io/foo": "1", "kvgpu.io/gpumem": "3000"}))
    (w,) = _warnings(p)
    assert "kvgpu.io/foo" in w and "no GPU" in w and "kvgpu.io/gpumem" in w, w


@pytest.mark.parametrize("key", ["nvidia.com/gpumem", "nvidia.com/gpu", "nvidia.com/gpucores",
                                 "nvidia.com/gpumem-percentage"])
def test_hami_resources_as_annotations_are_refused(cluster: Cluster, namespace: str, webhooks: PoolView,
                                                   key: str) -> None:
    p = _create(cluster, _pod(namespace, "hami-ann", {key: "30"}))
    _refused(p, key, "is a container resource, not a pod annotation", "resources.limits")


def _deployment(namespace: str, name: str, own: dict[str, str], template: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace, "annotations": own},
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}}, "template": {
                "metadata": {"labels": {"app": name}, "annotations": template},
                "spec": {"containers": [{"name": "main", "image": "registry.invalid/cuda:12"}],
                         "nodeSelector": NO_NODE}}}}


def test_request_on_a_deployments_own_metadata_is_warned(cluster: Cluster, namespace: str,
                                                         webhooks: PoolView) -> None:
    p = _create(cluster, _deployment(namespace, "own", {"kvgpu.io/gpumem": "3000"}, {}))
    (w,) = _warnings(p)
    assert "kvgpu.io/gpumem" in w and "spec.template.metadata.annotations" in w, w
    # Both places (kustomize's commonAnnotations does that): nothing to say.
    p = _create(cluster, _deployment(namespace, "both", {"kvgpu.io/gpumem": "3000"}, {"kvgpu.io/gpumem": "3000"}))
    assert _warnings(p) == []
    cron = {"apiVersion": "batch/v1", "kind": "CronJob",
            "metadata": {"name": "nightly", "namespace": namespace, "annotations": {"nvidia.com/gpumem": "3000"}},
            "spec": {"schedule": "0 3 * * *", "jobTemplate": {"spec": {"template": {"spec": {
                "restartPolicy": "Never", "containers": [{"name": "main", "image": "registry.invalid/cuda:12"}]}}}}}}
    (w,) = _warnings(_create(cluster, cron))
    assert "nvidia.com/gpumem" in w and "spec.jobTemplate.spec.template.metadata.annotations" in w, w


def _pool_minimum(cluster: Cluster) -> tuple[int, str]:
    pools = json.loads(cluster.kubectl("get", "vgpupools", "-o", "json").stdout)["items"]
    return min((p["spec"]["minSliceMemory"], p["metadata"]["name"]) for p in pools)


def _wait_minimum(webhooks: PoolView, mib: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while webhooks.minimum.mib != mib and time.monotonic() < deadline:
        time.sleep(0.2)
    assert webhooks.minimum.mib == mib, webhooks.minimum


def test_milli_memory_is_refused_in_both_forms(cluster: Cluster, namespace: str, webhooks: PoolView) -> None:
    p = _create(cluster, _pod(namespace, "milli-ann", {"kvgpu.io/gpumem": "3000m"}))
    _refused(p, "kvgpu.io/gpumem", '"3000m"', "m is milli, not MiB: 3000m is 3")
    # The API server stores the limit 3000m as "3": refused below the minimum, saying why.
    p = _create(cluster, _pod(namespace, "milli-limit", limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000m"}))
    _refused(p, "nvidia.com/gpumem", '"3"', "below the minimum slice", "m is milli, not MiB: 3000m is 3")


def test_minimum_slice_comes_from_the_pools(cluster: Cluster, namespace: str, webhooks: PoolView) -> None:
    pool = {"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool",
            "metadata": {"name": POOL}, "spec": {"minSliceMemory": 100}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pool))
    try:
        mib, name = _pool_minimum(cluster)
        _wait_minimum(webhooks, mib)
        assert mib <= 100
        p = _create(cluster, _pod(namespace, "tiny", {"kvgpu.io/gpumem": "1"}))
        _refused(p, "kvgpu.io/gpumem", '"1"', f"below the minimum slice of {mib} MiB",
                 f'spec.minSliceMemory of VGPUPool "{name}"')
        if name == POOL:  # no other test's pool is smaller: the pool's own value counts
            assert _create(cluster, _pod(namespace, "small", {"kvgpu.io/gpumem": "128"})).returncode == 0
    finally:
        cluster.kubectl("delete", "vgpupool", POOL, "--ignore-not-found")
    # the workers watch the pools: the deletion counts as soon as it is delivered too
    rest = json.loads(cluster.kubectl("get", "vgpupools", "-o", "json").stdout)["items"]
    _wait_minimum(webhooks, min((p["spec"]["minSliceMemory"] for p in rest), default=SliceMinimum().mib))
