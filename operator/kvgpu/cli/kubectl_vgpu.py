"""``kubectl vgpu`` — a kubectl plugin (the ``kubectl-vgpu`` executable on PATH) for kvgpu.

    kubectl vgpu nodes [NODE ...] [-l SELECTOR] [-o wide|json]
        per card: slots, memory and cores used/total (counted from the VGPUClaims as the
        operator's allocator counts them), health
    kubectl vgpu claims [-n NS | -A] [--no-usage] [-o wide|json]
        VGPUClaims like `kubectl get vgpuclaims`, plus memory used and SM utilisation per card
        from the node agents' exporters (through the API server's pod proxy; "-" when unknown)
    kubectl vgpu why POD [-n NS] [-o json]
        why a pod is pending: its request as kvgpu reads it (or what is invalid in it), the
        NoGPUCapacity/FailedScheduling events, and which nodes have room now
    kubectl vgpu simulate -f FILE [-n NS] [--nodes N --cards K --card-memory MIB --model M] [-o json]
        would these pods fit now: node and cards per pod, else the binding constraint and what
        would have to free up (kvgpu.cli.simulate); exit status 1 when some pod does not fit
    kubectl vgpu quota [-n NS | -A] [-o json]
        per namespace: each GPU quota (ResourceQuota GPU keys, VGPUQuota) with used/hard as
        kvgpu counts them at bind (kvgpu.cli.vgpu.quota)
    kubectl vgpu doctor [NODE ...] [--no-sample] [--timeout S] [-n NS] [-o json]
        checks the install and every GPU node end to end, one line each: OK or what is wrong
        and the fix (kvgpu.cli.vgpu.doctor); exit status 1 when something failed
    kubectl vgpu top [-n NS | -A] [--containers] [--sort memory|sm|name|node] [-o json]
        per pod: GPU memory used/limit and SM use/limit from the node agents (kvgpu.cli.vgpu.top)

kubectl's connection flags work before or after the sub-command: ``--kubeconfig``,
``--context``, ``-n/--namespace``, ``-A/--all-namespaces``. The namespace defaults to the
context's. Permissions needed: list nodes; list VGPUClaims and VGPUPools; get pods and list
events in the namespace; for usage, list pods and get pods/proxy in the agents' namespace; for
quota, list ResourceQuotas, VGPUQuotas and VGPUClaims; for doctor and top, docs/operations.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from kvgpu.cli.vgpu import doctorio, views
from kvgpu.cli.vgpu.doctorio import AGENT_NAMESPACE, SAMPLE_IMAGE
from kvgpu.cli.vgpu.doctorio import AGENT_SELECTOR as AGENT_SELECTOR
from kvgpu.core import keys

USAGE_TIMEOUT_S = 5.0


@dataclass
class KubeOptions:
    kubeconfig: str | None = None
    context: str | None = None
    namespace: str | None = None
    all_namespaces: bool = False
    output: str = ""

    def merged(self, **sub: Any) -> KubeOptions:
        """Options given after the sub-command win over those given before it."""
        out = KubeOptions(**vars(self))
        for k, v in sub.items():
            if v not in (None, False, ""):
                setattr(out, k, v)
        return out


def _kube_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed([
        click.option("--kubeconfig", default=None,
                     help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)"),
        click.option("--context", default=None, help="kubeconfig context"),
        click.option("-n", "--namespace", default=None, help="namespace (default: the context's)"),
        click.option("-A", "--all-namespaces", is_flag=True, default=False, help="every namespace"),
        click.option("-o", "--output", type=click.Choice(["", "wide", "json"]), default="",
                     help="wide: more columns; json: machine-readable"),
    ]):
        f = opt(f)
    return f


# --------------------------------------------------------------------------- API access


def _current_namespace(opts: KubeOptions) -> str:
    if opts.namespace:
        return opts.namespace
    from kubernetes_asyncio.config import list_kube_config_contexts

    try:
        contexts, active = list_kube_config_contexts(opts.kubeconfig)
    except Exception:
        return "default"
    ctx = next((c for c in contexts if c.get("name") == opts.context), None) if opts.context else active
    return str(((ctx or {}).get("context") or {}).get("namespace") or "default")


@asynccontextmanager
async def connect(opts: KubeOptions) -> AsyncIterator[Any]:
    """A kubernetes_asyncio ``ApiClient``: the kubeconfig (file, context) like kubectl, or the
    in-cluster service account when there is no kubeconfig at all."""
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    if opts.kubeconfig and not Path(opts.kubeconfig).expanduser().exists():  # noqa: ASYNC240
        raise click.ClickException(f"kubeconfig file {opts.kubeconfig} does not exist")
    try:
        await config.load_kube_config(
            config_file=opts.kubeconfig, context=opts.context, client_configuration=cfg)
    except config.ConfigException as e:
        if opts.kubeconfig or opts.context:
            raise click.ClickException(f"kubeconfig: {e}") from e
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            raise click.ClickException(f"no kubeconfig found and not in a cluster: {e}") from e
    async with client.ApiClient(configuration=cfg) as api:
        yield api


def _plain(api: Any, obj: Any) -> Any:
    return obj if isinstance(obj, dict) else api.sanitize_for_serialization(obj)


def _api_error(e: Exception, what: str) -> click.ClickException:
    from kubernetes_asyncio.client.exceptions import ApiException

    if isinstance(e, ApiException):
        reason = e.reason
        try:
            reason = json.loads(e.body or "{}").get("message") or reason
        except (ValueError, AttributeError):
            pass
        return click.ClickException(f"{what}: {reason} ({e.status})")
    return click.ClickException(f"{what}: {e}")


async def _list_nodes(api: Any, selector: str | None = None) -> list[dict[str, Any]]:
    from kubernetes_asyncio import client

    res = await client.CoreV1Api(api).list_node(label_selector=selector or "")
    return list(_plain(api, res)["items"])


async def _list_custom(api: Any, plural: str, namespace: str | None) -> list[dict[str, Any]]:
    from kubernetes_asyncio import client

    co = client.CustomObjectsApi(api)
    if namespace is None:
        res = await co.list_cluster_custom_object(keys.GROUP, keys.VERSION, plural)
    else:
        res = await co.list_namespaced_custom_object(keys.GROUP, keys.VERSION, namespace, plural)
    return list(res.get("items") or [])


async def _optional(coro: Any, default: Any) -> Any:
    """``coro``'s result, or ``default`` where the API refuses it (403: no right; 404: no CRD)."""
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        return await coro
    except ApiException as e:
        if e.status in (403, 404):
            return default
        raise


async def agent_usage(api: Any, nodes: set[str], namespace: str = AGENT_NAMESPACE,
                      timeout_s: float = USAGE_TIMEOUT_S) -> dict[views.UsageKey, views.Usage]:
    """Scrape the agents of ``nodes`` through the API server's pod proxy. Best effort: an agent
    that is missing, not ready or not allowed to be reached adds nothing."""
    by_node = {p["spec"].get("nodeName"): p for p in await doctorio.agent_pods(api, namespace)
               if (p.get("status") or {}).get("phase") == "Running"}
    texts = await asyncio.gather(*(doctorio.scrape(api, by_node[n], namespace, timeout_s)
                                   for n in sorted(nodes) if n in by_node))
    out: dict[views.UsageKey, views.Usage] = {}
    for text, err in texts:
        if err is None:
            with contextlib.suppress(ValueError):
                out.update(views.parse_usage(text))
    return out


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


# --------------------------------------------------------------------------- commands


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@_kube_options
@click.pass_context
def main(ctx: click.Context, **kw: Any) -> None:
    """kvgpu's view of GPU slices: cards, claims, and why a pod is pending."""
    from kvgpu.logs import configure_logging

    configure_logging("WARNING")  # on stderr: the operator code it reuses logs; stdout is the answer
    ctx.obj = KubeOptions(**kw)


@main.command("nodes")
@click.argument("names", nargs=-1)
@click.option("-l", "--selector", default=None, help="node label selector")
@_kube_options
@click.pass_obj
def nodes_cmd(obj: KubeOptions, names: tuple[str, ...], selector: str | None, **kw: Any) -> None:
    """Per card: slots, memory and cores used/total (counted from the VGPUClaims), health."""
    opts = obj.merged(**kw)

    async def run() -> list[views.CardRow]:
        async with connect(opts) as api:
            try:
                nodes, pools, claims = await asyncio.gather(
                    _list_nodes(api, selector), _optional(_list_custom(api, "vgpupools", None), []),
                    _optional(_list_custom(api, "vgpuclaims", None), None))
            except Exception as e:
                raise _api_error(e, "listing nodes") from e
        if names:
            missing = set(names) - {n["metadata"]["name"] for n in nodes}
            if missing:
                raise click.ClickException(f"node(s) not found: {', '.join(sorted(missing))}")
            nodes = [n for n in nodes if n["metadata"]["name"] in names]
        # each node's use, counted from the claims by the operator's allocator (nothing per node is
        # written for it); claims not readable: only the cards and their totals
        allocations = None if claims is None else views.node_allocations(nodes, pools, claims)
        return views.card_rows(nodes, allocations)

    rows = asyncio.run(run())
    if opts.output == "json":
        _emit_json([r.to_json() for r in rows])
        return
    if not rows:
        click.echo("No GPU nodes found (no node has a kvgpu inventory).", err=True)
        return
    wide = opts.output == "wide"
    click.echo(views.table(views.CARD_HEADERS_WIDE if wide else views.CARD_HEADERS,
                           [r.cells(wide) for r in rows]))


@main.command("claims")
@click.option("--usage/--no-usage", default=True, show_default=True,
              help="ask the node agents for memory used and SM utilisation")
@click.option("--agent-namespace", default=AGENT_NAMESPACE, show_default=True)
@_kube_options
@click.pass_obj
def claims_cmd(obj: KubeOptions, usage: bool, agent_namespace: str, **kw: Any) -> None:
    """VGPUClaims (like `kubectl get vgpuclaims`) with usage when the agents report it."""
    opts = obj.merged(**kw)
    ns = None if opts.all_namespaces else _current_namespace(opts)

    async def run() -> list[views.ClaimRow]:
        async with connect(opts) as api:
            try:
                claims = await _list_custom(api, "vgpuclaims", ns)
            except Exception as e:
                raise _api_error(e, "listing VGPUClaims") from e
            live = [c for c in claims if (c.get("status") or {}).get("phase") not in ("Released", "Failed")]
            used = {}
            if usage and live:
                used = await agent_usage(api, {str((c.get("spec") or {}).get("node")) for c in live},
                                         agent_namespace)
        return views.claim_rows(claims, _now(), used)

    rows = asyncio.run(run())
    if opts.output == "json":
        _emit_json([r.to_json() for r in rows])
        return
    if not rows:
        where = "any namespace" if ns is None else f"namespace {ns}"
        click.echo(f"No VGPUClaims found in {where}.", err=True)
        return
    wide = opts.output == "wide"
    click.echo(views.table(views.claim_headers(ns is None, wide), [r.cells(ns is None, wide) for r in rows]))


@main.command("why")
@click.argument("pod")
@_kube_options
@click.pass_obj
def why_cmd(obj: KubeOptions, pod: str, **kw: Any) -> None:
    """Why POD is pending (or where it went): request, events, room on the nodes."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    opts = obj.merged(**kw)
    ns = _current_namespace(opts)
    if "/" in pod:  # pod/NAME like kubectl
        kind, _, pod = pod.partition("/")
        if kind not in ("pod", "pods", "po"):
            raise click.BadParameter("give a pod name (or pod/NAME)", param_hint="POD")

    async def run() -> views.Explanation:
        async with connect(opts) as api:
            core = client.CoreV1Api(api)
            try:
                body = _plain(api, await core.read_namespaced_pod(pod, ns))
            except ApiException as e:
                if e.status == 404:
                    raise click.ClickException(f'pod "{pod}" not found in namespace {ns}') from e
                raise _api_error(e, "reading the pod") from e
            body.setdefault("apiVersion", "v1")
            body.setdefault("kind", "Pod")

            async def events() -> list[dict[str, Any]]:
                try:
                    res = await core.list_namespaced_event(ns, field_selector=f"involvedObject.name={pod}")
                    return list(_plain(api, res)["items"])
                except Exception:
                    return []

            try:
                evs, nodes, pools, claims = await asyncio.gather(
                    events(), _list_nodes(api), _optional(_list_custom(api, "vgpupools", None), []),
                    _optional(_list_custom(api, "vgpuclaims", None), None))
            except Exception as e:
                raise _api_error(e, "listing nodes, pools and claims") from e
        return views.explain_pod(body, events=evs, nodes=nodes, pools=pools, claims=claims, now=_now())

    ex = asyncio.run(run())
    if opts.output == "json":
        _emit_json(ex.to_json())
        return
    click.echo(views.format_explanation(ex))


@main.command("simulate")
@click.option("-f", "--filename", "files", multiple=True, required=True,
              help="Pods, Deployments, ReplicaSets, StatefulSets, Jobs, CronJobs or a List (YAML/JSON; - = stdin)")
@click.option("--nodes", "n_nodes", type=click.IntRange(1, 100000), default=None,
              help="a hypothetical cluster of this many nodes instead of the live one")
@click.option("--cards", type=click.IntRange(1, 64), default=8, show_default=True, help="cards per hypothetical node")
@click.option("--card-memory", type=click.IntRange(1, 1 << 20), default=143771, show_default=True,
              help="MiB per hypothetical card")
@click.option("--model", default="NVIDIA H200", show_default=True, help="hypothetical card model")
@click.option("--split-count", type=click.IntRange(1, 100), default=10, show_default=True,
              help="hypothetical pool's splitCount")
@click.option("--memory-scaling", type=click.FloatRange(0, 16, min_open=True), default=1.0, show_default=True,
              help="hypothetical pool's memoryScaling")
@_kube_options
@click.pass_obj
def simulate_cmd(obj: KubeOptions, files: tuple[str, ...], n_nodes: int | None, cards: int, card_memory: int,
                 model: str, split_count: int, memory_scaling: float, **kw: Any) -> None:
    """Would these pods fit now? On which nodes and cards; for the others, the binding
    constraint and what would have to free up. Decided by the operator's own allocator on the
    cluster's nodes, pools and claims (or on a hypothetical cluster with --nodes)."""
    from kvgpu.cli import simulate as sim
    from kvgpu.reconcile.state import OperatorState

    opts = obj.merged(**kw)
    try:
        ns = opts.namespace or ("default" if n_nodes is not None else _current_namespace(opts))
        pods = sim.expand(sim.load(files), ns)
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    problems: list[str] = []
    if n_nodes is not None:
        nodes, pools = sim.hypothetical(n_nodes, cards, card_memory, model, split_count=split_count,
                                        memory_scaling=memory_scaling)
        state, holders = OperatorState(), {}
        state.rebuild(nodes, pools, [])
    else:
        async def run() -> Any:
            async with connect(opts) as api:
                try:
                    return await sim.live_state(api)
                except Exception as e:
                    raise _api_error(e, "listing nodes, pools and claims") from e

        state, holders, problems = asyncio.run(run())
    verdicts = sim.simulate(state, pods, holders=holders, quota=getattr(state, "quota_refusal", None))
    if opts.output == "json":
        _emit_json({"pods": [v.to_json() for v in verdicts], "problems": problems})
    else:
        click.echo(views.table(sim.HEADERS, sim.rows(verdicts)))
        for line in sim.details(verdicts):
            click.echo(line)
        click.echo(sim.summary(verdicts))
    if not all(v.fits for v in verdicts):
        sys.exit(1)


@main.command("quota")
@_kube_options
@click.pass_obj
def quota_cmd(obj: KubeOptions, **kw: Any) -> None:
    """Per namespace: each GPU quota's used/hard (memory MiB, cores in percent-of-card units,
    cards, slices), counted from the live VGPUClaims as the operator counts them at bind."""
    from kubernetes_asyncio import client

    from kvgpu.cli.vgpu import quota as qv

    opts = obj.merged(**kw)
    ns = None if opts.all_namespaces else _current_namespace(opts)

    async def run() -> list[qv.QuotaRow]:
        async with connect(opts) as api:
            core = client.CoreV1Api(api)
            try:
                rqs = (core.list_resource_quota_for_all_namespaces() if ns is None
                       else core.list_namespaced_resource_quota(ns))
                res, vqs, claims = await asyncio.gather(
                    rqs, _list_custom(api, "vgpuquotas", ns), _list_custom(api, "vgpuclaims", ns))
            except Exception as e:
                raise _api_error(e, "listing ResourceQuotas, VGPUQuotas and VGPUClaims") from e
            return qv.quota_rows(_plain(api, res)["items"], vqs, claims)

    rows = asyncio.run(run())
    if opts.output == "json":
        _emit_json([r.to_json() for r in rows])
        return
    if not rows:
        where = "any namespace" if ns is None else f"namespace {ns}"
        click.echo(f"No GPU quota found in {where}.", err=True)
        return
    click.echo(views.table(qv.headers(ns is None), [r.cells(ns is None) for r in rows]))


@main.command("doctor")
@click.argument("names", nargs=-1)
@click.option("--sample/--no-sample", default=True, show_default=True,
              help="run a pod with a slice on each node (NVML must show the slice's memory)")
@click.option("--sample-image", default=SAMPLE_IMAGE, show_default=True,
              help="image of the sample pod: nvidia-smi, or python3 with pynvml")
@click.option("--timeout", "timeout_s", type=click.FloatRange(5, 3600), default=120.0, show_default=True,
              help="seconds a sample pod may take")
@click.option("--agent-namespace", default=AGENT_NAMESPACE, show_default=True)
@click.option("--resource-name", default="nvidia.com/gpu", show_default=True, help="the device plugin's resource")
@_kube_options
@click.pass_obj
def doctor_cmd(obj: KubeOptions, names: tuple[str, ...], sample: bool, sample_image: str, timeout_s: float,
               agent_namespace: str, resource_name: str, **kw: Any) -> None:
    """Check the install and each GPU node end to end; one line per node: OK, or what is wrong
    and how to fix it. Exit status 1 when any check failed."""
    from kvgpu.cli.vgpu import doctor

    opts = obj.merged(**kw)
    dopts = doctorio.Options(namespace=_current_namespace(opts), nodes=names, agent_namespace=agent_namespace,
                             system_namespace=agent_namespace, resource=resource_name, sample=sample,
                             sample_image=sample_image, timeout_s=timeout_s)

    async def run() -> doctorio.Report:
        async with connect(opts) as api:
            try:
                return await doctorio.run_doctor(api, dopts)
            except ValueError as e:
                raise click.ClickException(str(e)) from e
            except Exception as e:
                raise _api_error(e, "checking the cluster") from e

    report = asyncio.run(run())
    if opts.output == "json":
        _emit_json(report.to_json())
    else:
        click.echo(doctor.line("cluster", report.cluster))
        for node, findings in report.nodes.items():
            click.echo(doctor.line(node, findings))
        if not report.nodes:
            click.echo("no GPU node found (no node has the kvgpu.io/gpu-node label, an inventory or "
                       f"{resource_name} capacity)")
    if report.failed or not report.nodes:
        sys.exit(1)


@main.command("top")
@click.option("--containers", is_flag=True, default=False, help="a row per container instead of per pod")
@click.option("--sort", "sort_by", type=click.Choice(["memory", "sm", "name", "node"]), default="memory",
              show_default=True, help="memory/sm: highest use first")
@click.option("--agent-namespace", default=AGENT_NAMESPACE, show_default=True)
@_kube_options
@click.pass_obj
def top_cmd(obj: KubeOptions, containers: bool, sort_by: str, agent_namespace: str, **kw: Any) -> None:
    """Per pod (or container): GPU memory used/limit (MiB) and SM use/limit (% of a card), as the
    node agents read them from the shim's regions."""
    from kvgpu.cli.vgpu import top

    opts = obj.merged(**kw)
    ns = None if opts.all_namespaces else _current_namespace(opts)

    async def run() -> tuple[list[Any], list[str]]:
        async with connect(opts) as api:
            return await doctorio.usage(api, agent_namespace)

    uses, problems = asyncio.run(run())
    for p in problems:
        click.echo(f"warning: {p}", err=True)
    rows = top.rows(uses, containers=containers, namespace=ns, sort=sort_by)
    if opts.output == "json":
        _emit_json([r.to_json() for r in rows])
    elif rows:
        click.echo(views.table(top.headers(ns is None, containers), top.render(rows, ns is None, containers)))
    else:
        where = "any namespace" if ns is None else f"namespace {ns}"
        click.echo(f"No GPU pods reported by the node agents in {where}.", err=True)


if __name__ == "__main__":
    sys.exit(main())
