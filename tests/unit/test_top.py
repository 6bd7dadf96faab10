"""``kubectl vgpu top`` from the agent's real exporter (kvgpu.agent.exporter.UsageCollector over
region rows as the shim's reader returns them, rendered by prometheus_client): the metric names
top reads are the ones the agent exports; grouping per pod/container, sorting, rendering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from kvgpu.agent.exporter import DeviceUsage, UsageCollector, containers_of_pod, make_registry
from kvgpu.cli.vgpu import agentmetrics, top
from kvgpu.cli.vgpu.views import table
from kvgpu.core import keys
from kvgpu.core.inventory import Card, NodeInventory, Slicing
from prometheus_client import generate_latest

U0, U1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"
INV = NodeInventory("gpu-0", (Card(U0, 0, "NVIDIA H200", 143771, 132, 0, slicing=Slicing("default", 10)),
                              Card(U1, 1, "NVIDIA H200", 143771, 132, 1, slicing=Slicing("default", 10))))


def _pod(name: str, claims: dict[str, str], ns: str = "team") -> dict:
    return {"metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}",
                         "annotations": {keys.claim_annotation(c): t for c, t in claims.items()}},
            "spec": {"nodeName": "gpu-0", "containers": [{"name": c} for c in claims]},
            "status": {"phase": "Running"}}


def _metrics(tmp_path: Path) -> str:
    pods = [
        _pod("train", {"main": f"v1;claim=team/train-main;priority=1;dev={U0},3000,30;dev={U1},2000,0",
                       "side": f"v1;claim=team/train-side;priority=1;dev={U1},1000,20"}),
        _pod("infer", {"main": f"v1;claim=team/infer-main;priority=1;dev={U0},4000,50"}),
        _pod("idle", {"main": f"v1;claim=other/idle-main;priority=1;dev={U1},500,0"}, ns="other"),
    ]
    regions = {tmp_path / "uid-train" / "main": [DeviceUsage(U0, 3000, 1024.0, (7,)),
                                                 DeviceUsage(U1, 2000, 512.0, (7,))],
               tmp_path / "uid-train" / "side": [DeviceUsage(U1, 1000, 100.0, (9,))],
               tmp_path / "uid-infer" / "main": [DeviceUsage(U0, 4000, 3000.0, (3,))]}
    sm = {("uid-train", "main", U0): 20.0, ("uid-train", "main", U1): 5.0, ("uid-train", "side", U1): 10.0,
          ("uid-infer", "main", U0): 45.0}
    col = UsageCollector("gpu-0", lambda: [c for p in pods for c in containers_of_pod(p)], lambda: INV,
                         reader=regions.get, region_root=str(tmp_path), utilization=lambda: sm)
    return generate_latest(make_registry(col)).decode()


def test_parse_reads_the_agents_names(tmp_path: Path) -> None:
    uses = {(u.pod, u.container, u.device_index): u for u in agentmetrics.parse(_metrics(tmp_path))}
    train = uses[("train", "main", "0")]
    assert (train.node, train.namespace, train.device_uuid) == ("gpu-0", "team", U0)
    assert (train.used_bytes, train.limit_bytes, train.sm_percent, train.core_limit_percent) == \
        (1024 * 2**20, 3000 * 2**20, 20.0, 30.0)
    idle = uses[("idle", "main", "1")]  # no region read yet: limit known, use unknown
    assert idle.limit_bytes == 500 * 2**20 and idle.used_bytes is None and idle.sm_percent is None


def test_rows_per_pod_and_per_container_sorted(tmp_path: Path) -> None:
    uses = agentmetrics.parse(_metrics(tmp_path))
    rows = top.rows(uses)
    assert [(r.namespace, r.pod) for r in rows] == [("team", "infer"), ("team", "train"), ("other", "idle")]
    train = rows[1]
    assert train.cards == ("0", "1") and train.memory_used_mib == 1636 and train.memory_limit_mib == 6000
    assert (train.sm_percent, train.sm_limit_percent) == (35.0, 50.0)
    assert [r.pod for r in top.rows(uses, sort="name")] == ["idle", "infer", "train"]
    assert [r.pod for r in top.rows(uses, sort="sm")][:2] == ["infer", "train"]
    only = top.rows(uses, namespace="team", containers=True, sort="name")
    assert [(r.pod, r.container) for r in only] == [("infer", "main"), ("train", "main"), ("train", "side")]
    with pytest.raises(ValueError, match="sort key 'cpu': one of memory, sm, name, node"):
        top.rows(uses, sort="cpu")


def test_rendering(tmp_path: Path) -> None:
    rows = top.rows(agentmetrics.parse(_metrics(tmp_path)))
    text = table(top.headers(True, False), top.render(rows, True, False)).splitlines()
    assert text[0].split() == ["NAMESPACE", "POD", "NODE", "GPU", "MEMORY(MiB)", "USED/LIMIT", "SM(%)", "USED/LIMIT"]
    assert text[1].split() == ["team", "infer", "gpu-0", "0", "3000/4000", "45/50"]
    assert text[2].split() == ["team", "train", "gpu-0", "0,1", "1636/6000", "35/50"]
    assert text[3].split() == ["other", "idle", "gpu-0", "1", "-/500", "-/none"]
    one_ns = top.render(top.rows(agentmetrics.parse(_metrics(tmp_path)), containers=True, namespace="team"),
                        False, True)
    assert one_ns[0] == ["infer", "main", "gpu-0", "0", "3000/4000", "45/50"]
    assert json.loads(json.dumps(rows[0].to_json()))["cards"] == ["0"]


def test_top_command_through_the_pod_proxy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command with the API client replaced by a fake (no cluster in a unit test): it lists the
    agents, reads each through the pod proxy, and warns about one that does not answer."""
    import contextlib

    from kubernetes_asyncio import client
    from kvgpu.cli import kubectl_vgpu

    text = _metrics(tmp_path)

    class FakeCore:
        def __init__(self, api: object) -> None:
            pass

        async def list_namespaced_pod(self, namespace: str, label_selector: str) -> dict:
            return {"items": [{"metadata": {"name": f"agent-{n}"}, "spec": {"nodeName": n},
                               "status": {"phase": "Running"}} for n in ("gpu-0", "gpu-1")]}

        async def connect_get_namespaced_pod_proxy_with_path(self, name: str, namespace: str, path: str) -> str:
            if name.startswith("agent-gpu-1"):
                raise OSError("connection refused")
            return text

    @contextlib.asynccontextmanager
    async def connect(opts: object):  # type: ignore[no-untyped-def]
        yield object()

    monkeypatch.setattr(client, "CoreV1Api", FakeCore)
    monkeypatch.setattr(kubectl_vgpu, "connect", connect)
    res = CliRunner().invoke(kubectl_vgpu.main, ["top", "-n", "team", "--containers", "--sort", "name"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].split()[:2] == ["POD", "CONTAINER"] and len(lines) == 4
    assert "warning: agent on gpu-1: connection refused" in res.stderr
