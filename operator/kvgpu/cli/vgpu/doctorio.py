"""The API side of ``kubectl vgpu doctor`` and ``kubectl vgpu top``: fetch once, then the pure
checks of :mod:`kvgpu.cli.vgpu.doctor` decide.

The agents' metrics are read through the API server's pod proxy
(``GET /api/v1/namespaces/<agent ns>/pods/<agent pod>:9394/proxy/metrics``): no port-forward and
no network path from the user to the nodes; the permission is ``get pods/proxy`` in the agents'
namespace only (not ``nodes/proxy``, which opens the kubelet's API).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgpu.core import keys

from . import agentmetrics, doctor

AGENT_NAMESPACE = "kvgpu-system"
AGENT_SELECTOR = "app.kubernetes.io/name=kvgpu,app.kubernetes.io/component=agent"
OPERATOR_SELECTOR = "app.kubernetes.io/name=kvgpu,app.kubernetes.io/component=operator"
SCHEDULER_SELECTOR = "app.kubernetes.io/name=kvgpu,app.kubernetes.io/component=scheduler"
AGENT_METRICS_PORT = doctor.AGENT_METRICS_PORT
SCRAPE_TIMEOUT_S = 5.0
#: the sample pod's default image: CUDA's base image (nvidia-smi comes from the node's driver)
SAMPLE_IMAGE = "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"


def _plain(api: Any, obj: Any) -> Any:
    return obj if isinstance(obj, dict) else api.sanitize_for_serialization(obj)


def api_message(e: Exception) -> str:
    """The API server's message of an ``ApiException`` (else ``str(e)``)."""
    body = getattr(e, "body", None)
    try:
        msg = json.loads(body or "{}").get("message") if body else None
    except (ValueError, AttributeError):
        msg = None
    return str(msg or getattr(e, "reason", None) or e)


async def agent_pods(api: Any, namespace: str) -> list[dict[str, Any]]:
    """The agent pods in ``namespace`` (``[]`` when they cannot be listed)."""
    from kubernetes_asyncio import client

    try:
        res = await client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=AGENT_SELECTOR)
    except Exception:
        return []
    return list(_plain(api, res)["items"])


async def scrape(api: Any, pod: Mapping[str, Any], namespace: str,
                 timeout_s: float = SCRAPE_TIMEOUT_S) -> tuple[str, str | None]:
    """``(metrics text, None)`` of agent ``pod`` (the object) through the pod proxy, or ``("", error)``."""
    from kubernetes_asyncio import client

    try:
        text = await asyncio.wait_for(client.CoreV1Api(api).connect_get_namespaced_pod_proxy_with_path(
            f"{pod['metadata']['name']}:{doctor.metrics_port(pod)}", namespace, "metrics"), timeout_s)
    except TimeoutError:
        return "", f"no answer in {timeout_s:.0f} s"
    except Exception as e:
        return "", api_message(e)
    return (text if isinstance(text, str) else str(text)), None


def _running_by_node(pods: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {str(p["spec"].get("nodeName")): p for p in pods if (p.get("status") or {}).get("phase") == "Running"}


async def usage(api: Any, agent_namespace: str) -> tuple[list[agentmetrics.CardUse], list[str]]:
    """Every running agent's container usage, and a line per agent that did not answer."""
    by_node = _running_by_node(await agent_pods(api, agent_namespace))
    texts = await asyncio.gather(*(scrape(api, p, agent_namespace) for p in by_node.values()))
    uses: list[agentmetrics.CardUse] = []
    problems = []
    for node, (text, err) in zip(by_node, texts, strict=True):
        if err is not None:
            problems.append(f"agent on {node}: {err}")
            continue
        try:
            uses += agentmetrics.parse(text)
        except ValueError as e:
            problems.append(f"agent on {node}: unreadable metrics: {e}")
    return uses, problems


# --------------------------------------------------------------------------- doctor


@dataclass
class Report:
    """``cluster``: the cluster-wide findings; ``nodes``: findings per GPU node."""

    cluster: list[doctor.Finding] = field(default_factory=list)
    nodes: dict[str, list[doctor.Finding]] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return any(f.failed for f in self.cluster) or any(f.failed for fs in self.nodes.values() for f in fs)

    def to_json(self) -> dict[str, Any]:
        return {"cluster": [f.to_json() for f in self.cluster],
                "nodes": {n: [f.to_json() for f in fs] for n, fs in self.nodes.items()}, "ok": not self.failed}


@dataclass(frozen=True)
class Options:
    """What doctor checks: ``nodes`` (names; empty = every GPU node), ``namespace`` of the sample
    pods, ``agent_namespace``/``system_namespace``, ``resource`` (the device plugin's), ``sample``
    on/off, ``sample_image``, the slice (``sample_mib`` MiB, ``sample_cores`` %), ``timeout_s``."""

    namespace: str
    nodes: tuple[str, ...] = ()
    agent_namespace: str = AGENT_NAMESPACE
    system_namespace: str = AGENT_NAMESPACE
    resource: str = "nvidia.com/gpu"
    sample: bool = True
    sample_image: str = SAMPLE_IMAGE
    sample_mib: int = 256
    sample_cores: int = 10
    timeout_s: float = 120.0


def is_gpu_node(node: dict[str, Any], resource: str) -> bool:
    meta = node.get("metadata") or {}
    return ((meta.get("labels") or {}).get(keys.NODE_LABEL_GPU) == "true"
            or keys.NODE_INVENTORY in (meta.get("annotations") or {})
            or resource in ((node.get("status") or {}).get("capacity") or {}))


async def _workloads(api: Any, namespace: str, selector: str) -> list[dict[str, Any]]:
    from kubernetes_asyncio import client

    apps = client.AppsV1Api(api)
    out: list[dict[str, Any]] = []
    for kind, call in (("Deployment", apps.list_namespaced_deployment),
                       ("StatefulSet", apps.list_namespaced_stateful_set)):
        with contextlib.suppress(Exception):
            for w in _plain(api, await call(namespace, label_selector=selector))["items"]:
                out.append({**w, "kind": kind})
    return out


async def _webhooks(api: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from kubernetes_asyncio import client

    adm = client.AdmissionregistrationV1Api(api)
    m = _plain(api, await adm.list_mutating_webhook_configuration())["items"]
    v = _plain(api, await adm.list_validating_webhook_configuration())["items"]
    return list(m), list(v)


async def _nvidia_pods(api: Any) -> dict[str, list[dict[str, Any]]]:
    from kubernetes_asyncio import client

    core = client.CoreV1Api(api)
    out: dict[str, list[dict[str, Any]]] = {}
    for sel in doctor.NVIDIA_PLUGIN_SELECTORS:
        with contextlib.suppress(Exception):
            for p in _plain(api, await core.list_pod_for_all_namespaces(label_selector=sel))["items"]:
                out.setdefault(str(p["spec"].get("nodeName")), []).append(p)
    return out


async def _dry_run(api: Any, opts: Options, node: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    from kubernetes_asyncio import client

    body = doctor.sample_pod(node, opts.namespace, opts.sample_image, opts.sample_mib, opts.sample_cores,
                             opts.timeout_s)
    try:
        return _plain(api, await client.CoreV1Api(api).create_namespaced_pod(opts.namespace, body,
                                                                             dry_run="All")), ""
    except Exception as e:
        return None, api_message(e)


async def run_sample(api: Any, opts: Options, node: dict[str, Any]) -> doctor.SampleOutcome:
    """Create the sample pod for ``node``, wait until it ends or ``timeout_s``, read its log and
    events, and delete it (always)."""
    from kubernetes_asyncio import client

    core = client.CoreV1Api(api)
    body = doctor.sample_pod(node, opts.namespace, opts.sample_image, opts.sample_mib, opts.sample_cores,
                             opts.timeout_s)
    try:
        name = (await core.create_namespaced_pod(opts.namespace, body)).metadata.name
    except Exception as e:
        return doctor.SampleOutcome(error=api_message(e))
    pod: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + opts.timeout_s
        while time.monotonic() < deadline:
            pod = _plain(api, await core.read_namespaced_pod(name, opts.namespace))
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                break
            await asyncio.sleep(1.0)
        phase = str((pod.get("status") or {}).get("phase", ""))
        log = ""
        with contextlib.suppress(Exception):
            log = str(await core.read_namespaced_pod_log(name, opts.namespace, container="check"))
        evs: list[str] = []
        with contextlib.suppress(Exception):
            res = _plain(api, await core.list_namespaced_event(opts.namespace,
                                                               field_selector=f"involvedObject.name={name}"))
            evs = [f"{e.get('reason')}: {e.get('message')}" for e in res["items"] if e.get("type") == "Warning"]
        return doctor.SampleOutcome(phase, str((pod.get("spec") or {}).get("nodeName") or ""), log, tuple(evs),
                                    timed_out=phase not in ("Succeeded", "Failed"))
    finally:
        with contextlib.suppress(Exception):
            await core.delete_namespaced_pod(name, opts.namespace, grace_period_seconds=0)


async def _node_findings(api: Any, opts: Options, node: dict[str, Any], agents: list[dict[str, Any]],
                         nvidia: list[dict[str, Any]], sample: bool) -> list[doctor.Finding]:
    name = node["metadata"]["name"]
    metrics_error: str | None = None
    running = _running_by_node(agents).get(name)
    if running is not None:
        metrics_error = (await scrape(api, running, opts.agent_namespace))[1]
    found = [
        doctor.check_agent(name, agents, metrics_error, opts.agent_namespace),
        doctor.check_inventory(node, agents, opts.agent_namespace),
        doctor.check_device_plugin(node, opts.resource, agents, opts.agent_namespace),
        doctor.check_nvidia_plugin(node, nvidia, opts.resource),
        doctor.check_shim(node, agents, opts.agent_namespace),
    ]
    if not sample:
        found.append(doctor.check_sample(None, opts.sample_mib, opts.timeout_s, opts.namespace))
    elif doctor.failures(found):  # a sample pod would only repeat the failure, slowly
        found.append(doctor.Finding("sample", doctor.SKIP, "not run: the node failed a check above"))
    else:
        outcome = await run_sample(api, opts, node)
        found.append(doctor.check_sample(outcome, opts.sample_mib, opts.timeout_s, opts.namespace))
    return found


async def run_doctor(api: Any, opts: Options) -> Report:
    """Fetch everything once, run every check; raises ``ValueError`` naming nodes not found."""
    from kubernetes_asyncio import client

    core = client.CoreV1Api(api)
    nodes = list(_plain(api, await core.list_node())["items"])
    if opts.nodes:
        missing = set(opts.nodes) - {n["metadata"]["name"] for n in nodes}
        if missing:
            raise ValueError(f"node(s) not found: {', '.join(sorted(missing))}")
        nodes = [n for n in nodes if n["metadata"]["name"] in opts.nodes]
    else:
        nodes = [n for n in nodes if is_gpu_node(n, opts.resource)]
    nodes.sort(key=lambda n: n["metadata"]["name"])
    report = Report()
    ops, scheds, (mut, val), agents, nvidia = await asyncio.gather(
        _workloads(api, opts.system_namespace, OPERATOR_SELECTOR),
        _workloads(api, opts.system_namespace, SCHEDULER_SELECTOR), _webhooks(api),
        agent_pods(api, opts.agent_namespace), _nvidia_pods(api))
    ns_obj = None
    with contextlib.suppress(Exception):
        ns_obj = _plain(api, await core.read_namespace(opts.namespace))
    report.cluster = [doctor.check_operator(ops, opts.system_namespace),
                      doctor.check_scheduler(scheds, opts.system_namespace), doctor.check_webhooks(mut, val),
                      doctor.check_namespace(ns_obj, opts.namespace)]
    if nodes and ns_obj is not None:
        report.cluster.append(doctor.check_admission(*await _dry_run(api, opts, nodes[0]), opts.namespace))
    sample = opts.sample and not any(f.failed for f in report.cluster)
    by_node: dict[str, list[dict[str, Any]]] = {}
    for p in agents:
        by_node.setdefault(str(p["spec"].get("nodeName")), []).append(p)
    results = await asyncio.gather(*(_node_findings(api, opts, n, by_node.get(n["metadata"]["name"], []),
                                                    nvidia.get(n["metadata"]["name"], []), sample) for n in nodes))
    report.nodes = {n["metadata"]["name"]: r for n, r in zip(nodes, results, strict=True)}
    if opts.sample and not sample:
        for fs in report.nodes.values():
            fs[-1] = doctor.Finding("sample", doctor.SKIP, "not run: a cluster-wide check failed")
    return report
