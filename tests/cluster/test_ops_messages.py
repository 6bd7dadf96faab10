"""Operations messages on the real control plane (issue 22, item 4): a pool shrunk or deleted
under live claims says so (condition, Events; the pods keep their cards), equally specific pools
name each other and the nodes (and the pods' scheduling failures name the conflict), a bind
failure reads as text (not the API server's JSON), a bind is logged, and expected faults (an API
server restart, the agent's node deleted) leave one-line warnings instead of tracebacks."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kvgpu.agent.kube import KubeApi
from kvgpu.agent.main import Agent, AgentConfig
from kvgpu.core import keys
from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.fakenodes import create_nodes

from tests.cluster.conftest import GpuEnv, pool_body, pool_conditions

pytestmark = pytest.mark.cluster


def _events_of(gpu: GpuEnv, name: str, namespace: str = "default") -> list[dict[str, Any]]:
    ev = json.loads(gpu.cluster.kubectl("get", "events", "-n", namespace, "-o", "json",
                                        f"--field-selector=involvedObject.name={name}").stdout)
    return list(ev["items"])


def _log_since(path: Path, offset: int) -> str:
    return path.read_bytes()[offset:].decode(errors="replace")


def test_pool_shrunk_and_deleted_under_live_claims(gpu: GpuEnv) -> None:
    (node,) = gpu.nodes(1, cards=1, memory_mib=20000)
    name = f"shrink-{gpu.ns}"
    sel = {"matchLabels": {"kvgpu.io/test": gpu.ns, keys.NODE_LABEL_GPU: "true"}}  # beats "default"
    gpu.apply(pool_body(name, {"nodeSelector": sel, "splitCount": 5}))
    try:
        gpu.wait(lambda: pool_conditions(gpu, name).get("Ready", {}).get("status") == "True", 30, "pool ready")
        gpu.create(*[gpu.pod(f"s{i}", {"kvgpu.io/gpumem": "1000"}) for i in range(5)])
        for i in range(5):
            gpu.wait_bound(f"s{i}")
        gpu.apply(pool_body(name, {"nodeSelector": sel, "splitCount": 2}))
        over = gpu.wait(lambda: (c := pool_conditions(gpu, name).get("Overcommitted")) and c["status"] == "True" and c,
                        30, "Overcommitted=True")
        assert "slots 5/2" in over["message"] and node in over["message"], over
        assert "5 pod(s) keep running" in over["message"], over
        ev = gpu.wait(lambda: [e for e in _events_of(gpu, name) if e["reason"] == "Overcommitted"], 20,
                      "an Overcommitted Event on the pool")
        assert ev[0]["type"] == "Warning" and node in ev[0]["message"]
        # nothing is evicted: the pods and their claims stay
        assert all(p["spec"].get("nodeName") == node for p in gpu.pods())
        assert len([c for c in gpu.claims() if (c.get("status") or {}).get("phase") != "Released"]) == 5

        gpu.cluster.kubectl("delete", "vgpupool", name)
        gone = gpu.wait(lambda: [e for e in _events_of(gpu, name) if e["reason"] == "PoolDeletedInUse"], 20,
                        "a PoolDeletedInUse Event")
        assert gone[0]["type"] == "Warning" and "5 pod(s)" in gone[0]["message"] and node in gone[0]["message"]
        time.sleep(1)
        claims = gpu.claims()
        assert len(claims) == 5 and all((c.get("status") or {}).get("phase") != "Released" for c in claims)
    finally:
        gpu.cluster.kubectl("delete", "vgpupool", name, "--wait=false", check=False)


def test_equally_specific_pools_name_each_other_and_the_nodes(gpu: GpuEnv) -> None:
    (node,) = gpu.nodes(1, cards=1, memory_mib=20000)
    a, b = f"a-{gpu.ns}", f"b-{gpu.ns}"  # a sorts first: it wins
    gpu.apply(
        pool_body(a, {"splitCount": 1, "nodeSelector": {"matchLabels": {"kvgpu.io/test": gpu.ns,
                                                                    keys.NODE_LABEL_GPU: "true"}}}),
        pool_body(b, {"splitCount": 10, "nodeSelector": {
            "matchLabels": {"kvgpu.io/test": gpu.ns},
            "matchExpressions": [{"key": keys.NODE_LABEL_GPU, "operator": "Exists", "values": []}]}}))
    try:
        ca = gpu.wait(lambda: (c := pool_conditions(gpu, a)).get("Conflict", {}).get("status") == "True" and c, 30,
                      f"Conflict on {a}")
        cb = gpu.wait(lambda: (c := pool_conditions(gpu, b)).get("Conflict", {}).get("status") == "True" and c, 30,
                      f"Conflict on {b}")
        assert b in ca["Conflict"]["message"] and node in ca["Conflict"]["message"], ca
        assert a in cb["Conflict"]["message"] and node in cb["Conflict"]["message"], cb
        assert cb["Ready"]["reason"] == "LostConflict", cb["Ready"]
        assert "no card of any node matches" not in cb["Ready"]["message"] and a in cb["Ready"]["message"]
        # a's single slot is taken: the second pod's failure names the conflict, not just "no slot"
        gpu.create(gpu.pod("c0", {"kvgpu.io/gpumem": "1000"}))
        gpu.wait_bound("c0")
        gpu.create(gpu.pod("c1", {"kvgpu.io/gpumem": "1000"}))
        why = gpu.wait(lambda: [e for e in gpu.events("c1") if "conflict" in e], 30, "a reason naming the conflict")
        assert a in why[0] and b in why[0], why
    finally:
        gpu.cluster.kubectl("delete", "vgpupool", a, b, "--wait=false", check=False)


def test_bind_failure_is_text_and_binds_are_logged(gpu: GpuEnv) -> None:
    gpu.nodes(1, cards=1, memory_mib=20000)
    policy = f"refuse-binding-{gpu.ns}"
    gpu.cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": policy},
         "spec": {"failurePolicy": "Fail",
                  "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                          "operations": ["CREATE"], "resources": ["pods/binding"]}]},
                  "validations": [{"expression": f"!(request.namespace == '{gpu.ns}' && "
                                                 "object.metadata.name.startsWith('nobind'))",
                                   "message": "test policy: this pod may not be bound yet"}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": policy}, "spec": {"policyName": policy, "validationActions": ["Deny"]}}]}))
    log = gpu.system.operator_log()
    start = log.stat().st_size
    try:
        time.sleep(2)  # the policy takes a moment to be enforced
        gpu.create(gpu.pod("nobind", {"kvgpu.io/gpumem": "1000"}))
        failed = gpu.wait(lambda: [e for e in gpu.events("nobind") if "may not be bound" in e], 60,
                          "a bind failure Event")
        assert '"kind"' not in failed[0] and "{" not in failed[0], failed
        assert "Status" not in failed[0] and "apiVersion" not in failed[0], failed
        text = _log_since(log, start)
        lines = [ln for ln in text.splitlines() if "bind failed" in ln and "nobind" in ln]
        assert lines and all('"kind"' not in ln and "{" not in ln for ln in lines), lines
    finally:
        gpu.cluster.kubectl("delete", "validatingadmissionpolicybinding", policy, check=False)
        gpu.cluster.kubectl("delete", "validatingadmissionpolicy", policy, check=False)
    pod = gpu.wait_bound("nobind", 60)
    node = pod["spec"]["nodeName"]
    claim = pod["metadata"]["annotations"]["kvgpu.io/claims"]
    bound = gpu.wait(lambda: [ln for ln in _log_since(log, start).splitlines()
                              if re.search(r"\[info\s*\] bound ", ln) and f"{gpu.ns}/nobind" in ln], 10,
                     "an info line for the bind")
    assert node in bound[0] and claim in bound[0] and "main=0:1000MiB" in bound[0], bound


def test_apiserver_restart_leaves_warnings_not_tracebacks(gpu: GpuEnv) -> None:
    gpu.nodes(2, cards=2, memory_mib=20000)
    gpu.create(*[gpu.pod(f"r{i}", {"kvgpu.io/gpumem": "1000"}) for i in range(4)])
    for i in range(4):
        gpu.wait_bound(f"r{i}")
    log = gpu.system.operator_log()
    start = log.stat().st_size
    gpu.cluster.restart_component("kube-apiserver", down_s=3.0)
    gpu.create(*[gpu.pod(f"q{i}", {"kvgpu.io/gpumem": "1000"}) for i in range(4)])  # work goes on
    for i in range(4):
        gpu.wait_bound(f"q{i}", 60)
    time.sleep(12)  # pool status writes (5 s apart) and their Kopf events
    text = _log_since(log, start)
    assert text.count("Traceback") == 0, text[-6000:]
    warnings = [ln for ln in text.splitlines() if "[warning" in ln]
    assert warnings, "the restart left no warning at all"
    assert len(warnings) < 40, "\n".join(warnings)
    assert not [ln for ln in text.splitlines() if "succeeded." in ln and "Handler '" in ln]


async def test_agent_of_a_deleted_node_warns_once_and_recovers(cluster: Cluster, namespace: str, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    node = f"gone-{namespace}"
    sim = tmp_path / "sim.json"
    sim.write_text(json.dumps({"nodes": [{"name": node, "cards": [
        {"model": "NVIDIA H200", "memoryMiB": 143771, "smCount": 132, "numa": 0, "count": 1}]}]}))
    cfg = AgentConfig(node=node, simulated=str(sim), kubeconfig=str(cluster.kubeconfig), interval_s=5.0,
                      device_plugin=False, metrics_port=0, region_root=str(tmp_path / "regions"))
    caplog.set_level(logging.INFO, logger="kvgpu.agent")
    async with cluster.api() as api:
        core = client.CoreV1Api(api)

        async def inventory() -> str | None:
            try:
                n = await core.read_node(node)
            except client.exceptions.ApiException:
                return None
            return (n.metadata.annotations or {}).get(keys.NODE_INVENTORY)

        async def wait_inventory(limit_s: float) -> None:
            deadline = time.monotonic() + limit_s
            while not await inventory():
                assert time.monotonic() < deadline, "no inventory published"
                await asyncio.sleep(0.2)

        spec = SimulatedNode(node, (SimulatedCardSpec(count=1),))
        await create_nodes(api, [spec], with_inventory=False)
        agent = Agent(cfg, KubeApi(api), api)
        task = asyncio.create_task(agent.run())
        try:
            await wait_inventory(20)
            caplog.clear()
            await core.delete_node(node)
            await asyncio.sleep(16)  # the old agent: a traceback every 5 s
            assert not task.done()
            tracebacks = [r for r in caplog.records if r.exc_info]
            assert not tracebacks, [r.getMessage() for r in tracebacks]
            warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert 1 <= len(warned) <= 2, warned
            assert any(node in w and "not found" in w for w in warned), warned
            caplog.clear()
            await create_nodes(api, [spec], with_inventory=False)  # the node comes back
            await wait_inventory(10)
            # logged once the refresh that published the annotation has returned: a moment later
            deadline = time.monotonic() + 10
            while not any("working again" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, caplog.text
                await asyncio.sleep(0.1)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.gather(core.delete_node(node), return_exceptions=True)
