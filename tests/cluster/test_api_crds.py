"""The API against the real control plane: CRDs and examples apply, the API server refuses invalid
pools with readable messages (schema and CEL), defaults are filled in, and `kubectl get` shows the
printer columns."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio import client
from kvgpu.api.models import (
    ClaimPhase,
    VGPUClaim,
    VGPUClaimSpec,
    VGPUClaimStatus,
    VGPUPool,
    VGPUPoolStatus,
)
from kvgpu.api.requests import parse_pod
from kvgpu.core.keys import GROUP, VERSION
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.system import KvgpuSystem

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
UUID = "GPU-0fc3eda5-e98b-a25b-5b0d-d5c8d3f5a448"


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> Cluster:
    cluster.kubectl("apply", "-f", str(ROOT / "charts" / "kvgpu" / "crds"))
    for plural in ("vgpupools", "vgpuclaims"):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{plural}.{GROUP}", "--timeout=60s")
    return cluster


@pytest.fixture
def pools(crds: Cluster) -> Iterator[list[str]]:
    """Names of pools a test creates; deleted afterwards (pools are cluster-scoped)."""
    names: list[str] = []
    yield names
    for n in names:
        # waited for: examples/pool.yaml is "default", which the gpu fixture of a later test applies
        crds.kubectl("delete", "vgpupool", n, "--ignore-not-found", "--wait=true", "--timeout=60s", check=False)


def _pool_names(cluster: Cluster) -> set[str]:
    out = cluster.kubectl("get", "vgpupools", "-o", "jsonpath={.items[*].metadata.name}").stdout
    return set(out.split())


def _table(cluster: Cluster, *args: str) -> list[list[str]]:
    out = cluster.kubectl("get", *args).stdout
    return [re.split(r"\s{2,}", line.strip()) for line in out.strip().splitlines()]


def test_examples_apply(crds: Cluster, namespace: str, pools: list[str]) -> None:
    before = _pool_names(crds)
    example_pools = [
        d["metadata"]["name"]
        for p in EXAMPLES.glob("*.yaml")
        for d in yaml.safe_load_all(p.read_text())
        if d and d["kind"] == "VGPUPool"
    ]
    pools += [n for n in example_pools if n not in before]
    crds.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES))
    assert set(example_pools) <= _pool_names(crds)
    pods = crds.kubectl(
        "get", "pods", "-n", namespace, "-o", "jsonpath={.items[*].metadata.name}"
    ).stdout.split()
    assert {"cuda-slice", "cuda-slice-hami", "train-with-warmup"} <= set(pods)
    # pods as the server stores them (quantities canonicalised, e.g. 3000 -> "3k") mean the same
    for f in ("pod-annotations.yaml", "pod-hami.yaml", "pod-init-container.yaml"):
        local = yaml.safe_load((EXAMPLES / f).read_text())
        stored = json.loads(
            crds.kubectl("get", "pod", local["metadata"]["name"], "-n", namespace, "-o", "json").stdout
        )
        a, b = parse_pod(local), parse_pod(stored)
        assert a is not None and b is not None and a.containers == b.containers, f
    limits = json.loads(crds.kubectl("get", "pod", "cuda-slice-hami", "-n", namespace, "-o", "json").stdout)[
        "spec"
    ]["containers"][0]["resources"]["limits"]
    print(f"HAMi limits as stored by the API server: {limits}")
    # what the server stored still parses with our models
    body = json.loads(crds.kubectl("get", "vgpupool", "default", "-o", "json").stdout)
    assert VGPUPool.model_validate(body).spec.split_count == 10


def test_server_fills_defaults(crds: Cluster, pools: list[str]) -> None:
    pools.append("api-test-defaults")
    crds.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(
            {"apiVersion": f"{GROUP}/{VERSION}", "kind": "VGPUPool", "metadata": {"name": pools[-1]}}
        ),
    )
    body = json.loads(crds.kubectl("get", "vgp", pools[-1], "-o", "json").stdout)
    spec = body["spec"]
    assert spec["splitCount"] == 10 and spec["memoryScaling"] == 1 and spec["mode"] == "hami-core"
    assert spec["defaults"] == {"gpu": 1, "gpumem": 0, "gpucores": 0, "priority": 1}
    assert spec["scheduling"] == {"nodePolicy": "binpack", "gpuPolicy": "spread"}
    assert VGPUPool.model_validate(body).spec == VGPUPool(metadata={"name": "x"}).spec


INVALID_POOLS = sorted((EXAMPLES / "invalid").glob("pool-*.yaml"))


@pytest.mark.parametrize("path", INVALID_POOLS, ids=lambda p: p.name)
def test_invalid_pools_refused(crds: Cluster, path: Path, pools: list[str]) -> None:
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    pools.append(name)  # in case the server wrongly accepts it
    res = crds.kubectl("apply", "-f", str(path), check=False)
    assert res.returncode != 0, f"{path.name} was accepted"
    expected = [
        line[len("# expect: ") :] for line in path.read_text().splitlines() if line.startswith("# expect: ")
    ]
    assert expected
    for line in expected:
        assert line in res.stderr, res.stderr


def test_pool_columns(crds: Cluster, pools: list[str], kvgpu_system: KvgpuSystem) -> None:
    name = "api-test-columns"
    pools.append(name)
    crds.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(
            {"apiVersion": f"{GROUP}/{VERSION}", "kind": "VGPUPool", "metadata": {"name": name}}
        ),
    )
    # The operator writes a new pool's status once (then only when its own figures change): a
    # status patched before that write would be overwritten, so the test depends on the operator
    # being there in any order of the tests, and patches after its write.
    deadline = time.monotonic() + 30
    while not crds.kubectl("get", "vgpupool", name, "-o", "jsonpath={.status.observedGeneration}").stdout:
        assert time.monotonic() < deadline, "the operator wrote no status for the new pool"
        time.sleep(0.2)
    status = VGPUPoolStatus(
        nodes=10, cards=8, slots_used=3, slots_total=80, memory_used_mib=9000, memory_total_mib=8 * 143771
    )
    patch = json.dumps({"status": status.model_dump(mode="json", by_alias=True, exclude_none=True)})
    crds.kubectl("patch", "vgpupool", name, "--subresource=status", "--type=merge", "-p", patch)
    rows = _table(crds, "vgpupools", name)
    assert rows[0] == ["NAME", "NODES", "CARDS", "SLOTS", "MEMORY", "AGE"]
    assert rows[1][:5] == [name, "10", "8", "3/80", "9000Mi/1.1Ti"]
    wide = _table(crds, "vgp", name, "-o", "wide")
    got = dict(zip(wide[0], wide[1], strict=True))
    assert (got["MODE"], got["SPLIT"]) == ("hami-core", "10")


def _claim(namespace: str, name: str) -> VGPUClaim:
    spec = VGPUClaimSpec.model_validate(
        {
            "podName": "cuda-slice",
            "podUID": "0c9a7c8e-0000-4000-8000-000000000001",
            "container": "cuda",
            "node": "gpu-0",
            "pool": "default",
            "devices": [
                {"uuid": UUID, "index": 0, "model": "NVIDIA H200", "memory": 3000, "cores": 30},
                {"uuid": UUID[:-1] + "9", "index": 3, "model": "NVIDIA H200", "memory": 3000, "cores": 30},
            ],
        }
    )
    return VGPUClaim(metadata={"name": name, "namespace": namespace}, spec=spec)


async def test_claim_columns_immutability_and_phases(crds: Cluster, namespace: str) -> None:
    claim = _claim(namespace, "cuda-slice-cuda")
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(claim.to_body()))
    status = VGPUClaimStatus(phase=ClaimPhase.RESERVED, message="cards picked")
    patch = json.dumps({"status": status.model_dump(mode="json", by_alias=True, exclude_none=True)})
    crds.kubectl(
        "patch",
        "vgc",
        "cuda-slice-cuda",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        patch,
    )

    rows = _table(crds, "vgpuclaims", "-n", namespace)
    assert rows[0] == ["NAME", "POD", "CONTAINER", "NODE", "GPU", "MEMORY", "CORES", "PHASE", "AGE"]
    assert rows[1][:8] == [
        "cuda-slice-cuda",
        "cuda-slice",
        "cuda",
        "gpu-0",
        "0,3",
        "3000Mi",
        "30%",
        "Reserved",
    ]

    # read back with kubernetes_asyncio: the model accepts what the server stored
    async with crds.api() as api:
        got = await client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, "vgpuclaims", "cuda-slice-cuda"
        )
    assert VGPUClaim.model_validate(got).spec == claim.spec

    # spec is immutable (CEL)
    res = crds.kubectl(
        "patch",
        "vgc",
        "cuda-slice-cuda",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"node":"gpu-1"}}',
        check=False,
    )
    assert res.returncode != 0 and "spec is immutable" in res.stderr, res.stderr

    # Released is final
    def set_phase(phase: str) -> int:
        r = crds.kubectl(
            "patch",
            "vgc",
            "cuda-slice-cuda",
            "-n",
            namespace,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": {"phase": phase}}),
            check=False,
        )
        return int(r.returncode)

    assert set_phase("Running") == 0
    assert set_phase("Released") == 0
    res = crds.kubectl(
        "patch",
        "vgc",
        "cuda-slice-cuda",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status":{"phase":"Running"}}',
        check=False,
    )
    assert res.returncode != 0 and "a Released claim stays Released" in res.stderr, res.stderr
    assert set_phase("Bogus") != 0


def test_invalid_claim_refused(crds: Cluster, namespace: str) -> None:
    body = _claim(namespace, "bad").to_body()
    body["spec"]["devices"][0]["cores"] = 150
    body["spec"]["devices"][1]["uuid"] = body["spec"]["devices"][0]["uuid"]
    res = crds.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body), check=False)
    assert res.returncode != 0
    assert "spec.devices[0].cores" in res.stderr and "Duplicate value" in res.stderr, res.stderr


def test_kubectl_explain_shows_model_descriptions(crds: Cluster) -> None:
    out = crds.kubectl("explain", "vgpupool.spec.splitCount").stdout
    assert "Most slices (containers) sharing one card at a time" in out
    out = crds.kubectl("explain", "vgpuclaim.spec.devices.memory").stdout
    assert "Memory limit on this card, MiB" in out
