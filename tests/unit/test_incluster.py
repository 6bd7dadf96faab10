"""kvgpu.devcluster.incluster without a cluster: the chart rendered with the real node's values
(``helm template``) and run through the post-renderer carries every knob where the workloads
read it. The install itself (``helm install`` on the real node): tests/realnode/test_in_cluster.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from kvgpu.devcluster import incluster

from tests.helmkit import render

V = incluster.InClusterValues("kvgpu.local/op:1", "kvgpu.local/ag:1", "kvgpu.local/ks:v1.36.3", api_port=6443,
                              agent_args=("--simulated=/n/sim.json",), agent_host_paths=("/n",))


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return render(incluster.chart_values(V))


@pytest.fixture(scope="module")
def adapted(rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return incluster.adapt_for_real_node(rendered, V, b"API-CA")


def _spec(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return dict(incluster._find(docs, kind, name)["spec"]["template"]["spec"])


def test_chart_values_reach_the_workloads(rendered: list[dict[str, Any]]) -> None:
    # what the chart itself sets from chart_values, before any post-rendering
    op = _spec(rendered, "StatefulSet", "kvgpu-operator")
    assert op["hostNetwork"] is True and op["containers"][0]["image"] == V.operator_image
    assert op["containers"][0]["imagePullPolicy"] == "Never"
    assert f"--extender-address=0.0.0.0:{V.extender_port}" in op["containers"][0]["args"]
    assert "--extender-san=127.0.0.1" in op["initContainers"][0]["args"]  # the extender URL's host
    agent = _spec(rendered, "DaemonSet", "kvgpu-agent")
    assert "runtimeClassName" not in agent and agent["containers"][0]["image"] == V.agent_image
    sched = _spec(rendered, "Deployment", "kvgpu-scheduler")
    assert sched["containers"][0]["image"] == V.scheduler_image
    cfg = yaml.safe_load(incluster._find(rendered, "ConfigMap", "kvgpu-scheduler-config")["data"]["config.yaml"])
    assert [e["urlPrefix"] for e in cfg["extenders"]] == [V.extender_url] * 2  # filter, bind
    assert not [d for d in rendered if d["kind"] == "VGPUPool"]  # the fixture's pool is the node's


def test_operator_knobs(adapted: list[dict[str, Any]]) -> None:
    spec = _spec(adapted, "StatefulSet", "kvgpu-operator")
    for c in [*spec["initContainers"], *spec["containers"]]:  # the certs init container needs the API too
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == ("127.0.0.1", "6443"), c["name"]
        assert incluster.SA_MOUNT in {m["mountPath"] for m in c["volumeMounts"]}, c["name"]
        assert "requests" not in c.get("resources", {}), c["name"]
    c = next(c for c in spec["containers"] if c["name"] == "operator")
    assert sum(a.startswith("--webhook-port") for a in c["args"]) == 1
    assert f"--webhook-port={V.webhook_port}" in c["args"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "extender": V.extender_port, "metrics": V.metrics_port, "webhooks": V.webhook_port}
    assert incluster._find(adapted, "StatefulSet", "kvgpu-operator")["spec"]["replicas"] == 1
    assert spec["automountServiceAccountToken"] is False


def test_agent_and_scheduler_knobs(adapted: list[dict[str, Any]]) -> None:
    agent = _spec(adapted, "DaemonSet", "kvgpu-agent")
    [c] = agent["containers"]
    assert "--simulated=/n/sim.json" in c["args"] and f"--metrics-port={V.agent_metrics_port}" in c["args"]
    assert {"mountPath": "/n", "name": "node-0", "readOnly": True} in c["volumeMounts"]
    [s] = _spec(adapted, "Deployment", "kvgpu-scheduler")["containers"]
    assert f"--secure-port={V.scheduler_port}" in s["command"]


def test_mps_owner_knobs(adapted: list[dict[str, Any]]) -> None:
    ds = incluster._find(adapted, "DaemonSet", "kvgpu-mps")
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate"}  # kubectl rollout status waits for it
    spec = ds["spec"]["template"]["spec"]
    [c] = spec["containers"]
    assert "runtimeClassName" not in spec and c["image"] == V.agent_image and c["imagePullPolicy"] == "Never"
    assert {"mountPath": "/n", "name": "node-0", "readOnly": True} in c["volumeMounts"]
    assert "requests" not in c["resources"]
    v = incluster.InClusterValues(**{**V.__dict__, "agent_args": ("--driver-root=/n/driver",)})
    [c] = incluster._find(incluster.adapt_for_real_node(render(incluster.chart_values(v)), v, b""), "DaemonSet",
                          "kvgpu-mps")["spec"]["template"]["spec"]["containers"]
    assert "--driver-root=/n/driver" in c["args"]  # the simulated node's control program


def test_no_certificates_of_its_own(adapted: list[dict[str, Any]]) -> None:
    # the chart's operator issues them (kvgpu certs): the post-renderer adds none, sets no caBundle
    assert not [d for d in adapted if d["kind"] == "Secret"]
    bundles = {w["clientConfig"].get("caBundle") for d in adapted if d["kind"].endswith("WebhookConfiguration")
               for w in d["webhooks"]}
    assert bundles <= {None, ""}
    assert adapted[0]["kind"] == "ConfigMap" and adapted[0]["data"]["ca.crt"] == "API-CA"


def test_post_renderer_round_trip(tmp_path: Path) -> None:
    # as Helm runs it: the rendered stream on stdin, the adapted one on stdout
    vfile = tmp_path / "values.json"
    incluster._save_values(vfile, V, b"API-CA")
    stream = yaml.safe_dump_all(render(incluster.chart_values(V)))
    p = subprocess.run([sys.executable, "-m", "kvgpu.devcluster.incluster", "post-render", str(vfile)],
                       input=stream, capture_output=True, text=True, check=True)
    docs = [d for d in yaml.safe_load_all(p.stdout) if d]
    assert docs == incluster.adapt_for_real_node(render(incluster.chart_values(V)), V, b"API-CA")


def test_missing_workload_is_named(rendered: list[dict[str, Any]]) -> None:
    docs = [d for d in rendered if d["kind"] != "DaemonSet"]
    with pytest.raises(incluster.InClusterError, match="DaemonSet kvgpu-agent"):
        incluster.adapt_for_real_node(docs, V, b"")


def test_the_adapted_workloads_host_ports_are_distinct(adapted: list[dict[str, Any]]) -> None:
    # hostNetwork pods of one release on one node: a port two of them declare leaves one Pending
    pods = [{"metadata": {"name": d["metadata"]["name"], "namespace": "kvgpu-system"},
             "spec": d["spec"]["template"]["spec"]}
            for d in adapted if d["kind"] in ("StatefulSet", "Deployment", "DaemonSet")]
    held = incluster.host_ports(pods)
    ports = [p for ps in held.values() for p in ps]
    assert len(held) == 3 and len(ports) == 5 and len(set(ports)) == 5, held


def test_host_ports_counts_host_network_container_ports_and_host_ports() -> None:
    pods = [{"metadata": {"name": "a", "namespace": "x"},
             "spec": {"hostNetwork": True, "containers": [{"ports": [{"containerPort": 9000}]}]}},
            {"metadata": {"name": "b", "namespace": "x"},
             "spec": {"containers": [{"ports": [{"containerPort": 80}, {"containerPort": 81, "hostPort": 8081}]}]}},
            {"metadata": {"name": "c", "namespace": "x"}, "spec": {"containers": [{"ports": [{"containerPort": 80}]}]}}]
    assert incluster.host_ports(pods) == {"x/a": [9000], "x/b": [8081]}


def test_free_port_never_gives_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgpu.devcluster import cluster

    picks = iter([41000, 41000, 41000, 41001])

    class Sock:  # the kernel handing the same free port to successive asks
        def __enter__(self) -> Sock:
            return self

        def __exit__(self, *a: object) -> None:
            pass

        def bind(self, addr: object) -> None:
            self.port = next(picks)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(cluster, "_PORTS_GIVEN", set())
    monkeypatch.setattr(cluster, "socket", SimpleNamespace(socket=Sock))
    assert [cluster.free_port(), cluster.free_port()] == [41000, 41001]
