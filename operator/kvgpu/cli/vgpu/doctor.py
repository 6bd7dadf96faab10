"""``kubectl vgpu doctor``: the checks, as pure functions of what was fetched once (plain API
dicts, the agents' metrics text, the sample pod's outcome); the fetching is in
:mod:`kvgpu.cli.vgpu.doctorio`.

Each check returns a :class:`Finding` (``ok``, ``fail``, or ``skip`` = not checkable here) naming
what is wrong and the exact fix. Cluster-wide checks: :func:`check_operator`,
:func:`check_scheduler`, :func:`check_webhooks`, :func:`check_namespace`, :func:`check_admission`.
Per node: :func:`check_agent`, :func:`check_inventory`, :func:`check_device_plugin`,
:func:`check_nvidia_plugin`, :func:`check_shim`, :func:`check_sample`. :func:`line` renders one
line per node (or cluster part).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvgpu.core import keys
from kvgpu.core.inventory import NodeInventory

OK, FAIL, SKIP = "ok", "fail", "skip"
#: labels NVIDIA's device plugin pods carry (GPU Operator, its Helm chart, the static manifest)
NVIDIA_PLUGIN_SELECTORS = ("app=nvidia-device-plugin-daemonset", "app.kubernetes.io/name=nvidia-device-plugin",
                           "name=nvidia-device-plugin-ds")
SAMPLE_MARK = "KVGPU-DOCTOR"
PSA_ENFORCE = "pod-security.kubernetes.io/enforce"


@dataclass(frozen=True)
class Finding:
    """One check's verdict: ``status`` ok/fail/skip, ``message`` what was seen, ``fix`` what to do."""

    check: str
    status: str
    message: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def _ok(check: str, message: str) -> Finding:
    return Finding(check, OK, message)


def _fail(check: str, message: str, fix: str) -> Finding:
    return Finding(check, FAIL, message, fix)


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def _annotations(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("annotations") or {}


def _ready(pod: Mapping[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


# --------------------------------------------------------------------------- cluster-wide


def _workload_check(check: str, what: str, workloads: Sequence[Mapping[str, Any]], namespace: str,
                    absent: str) -> Finding:
    if not workloads:
        return Finding(check, SKIP, f"no {what} Deployment/StatefulSet in {namespace}; {absent}")
    bad = []
    for w in workloads:
        want = int((w.get("spec") or {}).get("replicas", 1) or 0)
        ready = int((w.get("status") or {}).get("readyReplicas", 0) or 0)
        if want > 0 and ready == 0:
            bad.append(f"{str(w.get('kind', 'Deployment')).lower()}/{_name(w)} 0/{want} ready")
    if bad:
        return _fail(check, f"{what}: {', '.join(bad)}",
                     f"kubectl -n {namespace} describe {bad[0].split()[0]}; kubectl -n {namespace} logs "
                     f"{bad[0].split()[0]}")
    return _ok(check, ", ".join(f"{_name(w)} {(w.get('status') or {}).get('readyReplicas', 0)}/"
                                f"{(w.get('spec') or {}).get('replicas', 1)} ready" for w in workloads))


def check_operator(workloads: Sequence[Mapping[str, Any]], namespace: str) -> Finding:
    """The operator's Deployment/StatefulSet (``app.kubernetes.io/component=operator``) has a
    ready replica; none found is ``skip`` (the admission dry run still checks the operator)."""
    return _workload_check("operator", "kvgpu operator", workloads, namespace,
                           "the admission check below tells whether an operator answers")


def check_scheduler(workloads: Sequence[Mapping[str, Any]], namespace: str) -> Finding:
    """The kvgpu kube-scheduler's Deployment (``app.kubernetes.io/component=scheduler``) has a
    ready replica; none found is ``skip`` (the sample pods are placed by it, which checks it)."""
    return _workload_check("scheduler", keys.SCHEDULER_NAME, workloads, namespace,
                           "the sample pods check scheduling")


def check_webhooks(mutating: Sequence[Mapping[str, Any]], validating: Sequence[Mapping[str, Any]]) -> Finding:
    """``kvgpu-mutate`` and ``kvgpu-validate`` exist and every webhook in them has a ``caBundle``
    (kube-apiserver cannot call a webhook whose serving certificate it cannot verify)."""
    missing = [n for n, objs in (("mutatingwebhookconfiguration/kvgpu-mutate", mutating),
                                 ("validatingwebhookconfiguration/kvgpu-validate", validating))
               if not any(_name(o) == n.split("/")[1] for o in objs)]
    if missing:
        return _fail("webhooks", f"{' and '.join(missing)} not found: pods are not admitted by kvgpu",
                     "install kvgpu: helm install kvgpu charts/kvgpu -n kvgpu-system --create-namespace")
    no_ca = [f"{_name(o)}/{w.get('name')}" for o in (*mutating, *validating) if _name(o).startswith("kvgpu-")
             for w in o.get("webhooks") or [] if not (w.get("clientConfig") or {}).get("caBundle")]
    if no_ca:
        return _fail("webhooks", f"webhook {', '.join(no_ca)} has no caBundle: kube-apiserver cannot verify "
                     "the operator's certificate", "set the caBundle: with cert-manager check the Certificate "
                     "(kubectl -n kvgpu-system get certificate,certificaterequest); without, re-run the chart's "
                     "certificate job: helm upgrade kvgpu charts/kvgpu -n kvgpu-system")
    return _ok("webhooks", "kvgpu-mutate and kvgpu-validate with caBundle")


PSA_LEVELS = ("privileged", "baseline", "restricted")


def check_namespace(namespace: Mapping[str, Any] | None, name: str) -> Finding:
    """The sample/tenant namespace exists and its PodSecurity ``enforce`` label is a level
    (unset = the cluster default). Every level admits kvgpu pods: the webhook injects no hostPath
    (the device plugin mounts the shim), so ``baseline`` passes and ``restricted`` passes a pod
    that complies itself (the finding says what it needs)."""
    if namespace is None:
        return _fail("namespace", f"namespace {name} not found", f"kubectl create namespace {name}, or --namespace")
    labels = (namespace.get("metadata") or {}).get("labels") or {}
    level = labels.get(PSA_ENFORCE, "")
    if level and level not in PSA_LEVELS:
        return _fail("namespace", f"namespace {name} has {PSA_ENFORCE}={level!r}, not one of {', '.join(PSA_LEVELS)}",
                     f"kubectl label namespace {name} {PSA_ENFORCE}=baseline --overwrite")
    note = (": GPU pods must run as non-root, drop ALL capabilities, use seccomp RuntimeDefault and "
            "allowPrivilegeEscalation: false") if level == "restricted" else ""
    return _ok("namespace", f"namespace {name}: PodSecurity enforce {level or 'not set (cluster default)'}{note}")


def check_admission(mutated: Mapping[str, Any] | None, error: str, namespace: str) -> Finding:
    """A server-side dry run of the sample pod: the kvgpu webhook mutated it (``schedulerName``
    ``kvgpu-scheduler``) and nothing (PodSecurity, a policy) refused it. ``error`` is the API's
    message when the dry run was refused, ``mutated`` the pod it returned."""
    if error:
        if "PodSecurity" in error or "violates" in error:
            return _fail("admission", f"the sample pod is refused in {namespace}: {error}",
                         "the sample pod meets PodSecurity restricted and kvgpu's webhook injects no hostPath: "
                         "a refusal naming hostPath volumes \"kvgpu-...\" means an older kvgpu webhook runs "
                         "(upgrade kvgpu); otherwise read what the message names")
        if "webhook" in error:
            return _fail("admission", f"kube-apiserver cannot call the kvgpu webhook: {error}",
                         "kubectl -n kvgpu-system get pods,endpoints -l app.kubernetes.io/name=kvgpu; "
                         "the operator must be Ready and its Service must have endpoints")
        return _fail("admission", f"the sample pod is refused in {namespace}: {error}",
                     "read the message: a policy or quota of the namespace refuses GPU pods")
    spec = (mutated or {}).get("spec") or {}
    if spec.get("schedulerName") != keys.SCHEDULER_NAME:
        return _fail("admission", f"the kvgpu webhook did not mutate a GPU pod in {namespace} (schedulerName "
                     f"{spec.get('schedulerName')!r})", f"namespace {namespace} is excluded by the webhook's "
                     "namespaceSelector (kube-system, kvgpu-system and the chart's excludes): pass "
                     "--namespace with a tenant namespace")
    return _ok("admission", f"a GPU pod in {namespace} is mutated for {keys.SCHEDULER_NAME}")


# --------------------------------------------------------------------------- per node


AGENT_METRICS_PORT = 9394  # the agent's default --metrics-port


def metrics_port(pod: Mapping[str, Any]) -> int:
    """The agent pod's metrics port: its container port named ``metrics`` (the chart's
    ``devicePlugin.metricsPort``), else :data:`AGENT_METRICS_PORT`."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        for port in c.get("ports") or []:
            if port.get("name") == "metrics" and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return AGENT_METRICS_PORT


def check_agent(node: str, pods: Sequence[Mapping[str, Any]], metrics_error: str | None,
                namespace: str) -> Finding:
    """An agent pod (``app.kubernetes.io/component=agent``) on ``node`` is Ready and its metrics
    answer through the API server's pod proxy (``metrics_error`` None = answered)."""
    if not pods:
        return _fail("agent", f"no kvgpu agent pod on the node (namespace {namespace})",
                     f"kubectl -n {namespace} describe daemonset kvgpu-agent (its node affinity or tolerations "
                     f"leave {node} out?); kubectl label node {node} kvgpu.io/gpu-node=true")
    ready = [p for p in pods if _ready(p)]
    if not ready:
        p = pods[0]
        phase = (p.get("status") or {}).get("phase", "Unknown")
        return _fail("agent", f"agent pod {_name(p)} is not Ready ({phase})",
                     f"kubectl -n {namespace} logs {_name(p)}; kubectl -n {namespace} describe pod {_name(p)}")
    if metrics_error is not None:
        pod = f"{_name(ready[0])}:{metrics_port(ready[0])}"
        return _fail("agent", f"agent pod {_name(ready[0])} does not answer on its metrics port through the API "
                     f"server: {metrics_error}", f"kubectl -n {namespace} get --raw /api/v1/namespaces/{namespace}"
                     f"/pods/{pod}/proxy/metrics (needs get pods/proxy in {namespace})")
    return _ok("agent", f"agent {_name(ready[0])} Ready")


def parse_inventory(node: Mapping[str, Any]) -> tuple[NodeInventory | None, str]:
    """The node's ``kvgpu.io/inventory`` parsed, or ``(None, why not)``."""
    text = _annotations(node).get(keys.NODE_INVENTORY)
    if not text:
        return None, f"no {keys.NODE_INVENTORY} annotation"
    try:
        return NodeInventory.loads(text), ""
    except (ValueError, KeyError, TypeError) as e:
        return None, f"{keys.NODE_INVENTORY} does not parse: {e}"


def agent_logs(node: Mapping[str, Any], agent_pods: Sequence[Mapping[str, Any]], namespace: str) -> str:
    """The command that shows the node's agent log (its pod when known, else how to find it)."""
    if agent_pods:
        return f"kubectl -n {namespace} logs {_name(agent_pods[0])}"
    return f"kubectl -n {namespace} get pods -o wide -l app.kubernetes.io/component=agent --field-selector " \
           f"spec.nodeName={_name(node)}, then its logs"


def check_inventory(node: Mapping[str, Any], agent_pods: Sequence[Mapping[str, Any]], agent_namespace: str) -> Finding:
    """The agent published a parseable inventory with at least one card a VGPUPool covers."""
    inv, why = parse_inventory(node)
    logs = agent_logs(node, agent_pods, agent_namespace)
    if inv is None:
        return _fail("inventory", why + " (the agent publishes it once it found the cards)",
                     f"{logs} (NVML or driver errors?)")
    if not inv.cards:
        return _fail("inventory", "the agent found no GPU on the node", "nvidia-smi on the node; the agent needs the "
                     "NVIDIA driver and NVIDIA_VISIBLE_DEVICES=all (container toolkit) or /dev/nvidia* mounted")
    sliced = [c for c in inv.cards if c.slicing is not None]
    if not sliced:
        return _fail("inventory", f"{len(inv.cards)} card(s) but no VGPUPool covers them",
                     "kubectl apply -f examples/pool.yaml (a VGPUPool whose nodeSelector matches the node)")
    healthy = [c for c in sliced if c.healthy]
    if not healthy:
        reason = next((c.reason for c in sliced if c.reason), "unhealthy")
        return _fail("inventory", f"every sliced card is unhealthy ({reason})",
                     f"kubectl describe node {_name(node)} (GPUUnhealthy events); a reset or reboot of the card")
    return _ok("inventory", f"{len(inv.cards)} card(s), {len(sliced)} sliced, {len(healthy)} healthy")


def expected_replicas(inv: NodeInventory | None) -> int | None:
    """Device-plugin replicas the agent offers for ``inv``: splitCount per sliced card."""
    if inv is None:
        return None
    return sum(c.slicing.split_count for c in inv.cards if c.slicing is not None)


def _quantity(node: Mapping[str, Any], field: str, resource: str) -> int:
    try:
        return int(str(((node.get("status") or {}).get(field) or {}).get(resource, "0")))
    except ValueError:
        return 0


def check_device_plugin(node: Mapping[str, Any], resource: str, agent_pods: Sequence[Mapping[str, Any]],
                        agent_namespace: str) -> Finding:
    """The kubelet took the agent's device plugin: ``resource`` in the node's capacity and
    allocatable > 0."""
    cap, alloc = _quantity(node, "capacity", resource), _quantity(node, "allocatable", resource)
    logs = agent_logs(node, agent_pods, agent_namespace)
    if cap == 0:
        return _fail("device-plugin", f"no {resource} in the node's capacity: the device plugin is not registered "
                     "with the kubelet", f"{logs} (registration refused? /var/lib/kubelet/device-plugins mounted?)")
    if alloc == 0:
        return _fail("device-plugin", f"{resource} capacity {cap} but allocatable 0 (every replica Unhealthy)",
                     f"kubectl describe node {_name(node)} (GPUUnhealthy events)")
    return _ok("device-plugin", f"{resource} {alloc}/{cap} allocatable")


def check_nvidia_plugin(node: Mapping[str, Any], nvidia_pods: Sequence[Mapping[str, Any]], resource: str) -> Finding:
    """NVIDIA's own device plugin is not running on the node, and the node's ``resource`` capacity
    is what kvgpu's plugin offers (splitCount per sliced card): two plugins for one resource name
    take turns in the kubelet."""
    if nvidia_pods:
        p = nvidia_pods[0]
        ns = (p.get("metadata") or {}).get("namespace", "")
        return _fail("nvidia-plugin", f"NVIDIA's device plugin also runs here ({ns}/{_name(p)}) and advertises "
                     f"{resource}", "GPU Operator: helm upgrade gpu-operator nvidia/gpu-operator -n "
                     f"{ns} --reuse-values --set devicePlugin.enabled=false; standalone: kubectl -n {ns} delete "
                     "daemonset nvidia-device-plugin-daemonset")
    want = expected_replicas(parse_inventory(node)[0])
    cap = _quantity(node, "capacity", resource)
    if want and cap and cap != want:
        return _fail("nvidia-plugin", f"{resource} capacity {cap}, but kvgpu offers {want} (splitCount per sliced "
                     "card): another device plugin registered the resource", "find it: kubectl get pods -A -o wide "
                     f"--field-selector spec.nodeName={_name(node)} | grep -i device-plugin; disable it")
    return _ok("nvidia-plugin", "no other device plugin for the resource")


def shim_status(node: Mapping[str, Any]) -> dict[str, Any] | None:
    """The agent's ``kvgpu.io/shim`` annotation (agent/shimcheck.py) parsed, or None."""
    text = _annotations(node).get(keys.NODE_SHIM)
    try:
        d = json.loads(text) if text else None
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


def check_shim(node: Mapping[str, Any], agent_pods: Sequence[Mapping[str, Any]], agent_namespace: str) -> Finding:
    """The agent reports the shim installed and loadable (``kvgpu.io/shim``)."""
    restart = (f"kubectl -n {agent_namespace} delete pod {_name(agent_pods[0])}" if agent_pods else
               f"kubectl -n {agent_namespace} rollout restart daemonset kvgpu-agent")
    st = shim_status(node)
    if st is None:
        return _fail("shim", f"the agent does not report the shim ({keys.NODE_SHIM} missing or unreadable)",
                     f"the agent installs it with --shim-source (the chart sets it); {restart}")
    if not st.get("loadable"):
        return _fail("shim", f"the shim is not usable on the node: {st.get('error') or 'not loadable'}",
                     f"{restart} (the agent reinstalls the shim at start)")
    return _ok("shim", f"{st.get('file')} loadable")


@dataclass(frozen=True)
class SampleOutcome:
    """What became of the sample pod: ``phase`` at the end, ``node`` it ran on, ``log`` its
    output, ``events`` (``reason: message``), ``timed_out``, ``error`` (creating it failed)."""

    phase: str = ""
    node: str = ""
    log: str = ""
    events: tuple[str, ...] = ()
    timed_out: bool = False
    error: str = ""


#: the sample container's check: NVML's view of card 0 (nvidia-smi, else python3 with pynvml)
SAMPLE_SCRIPT = (
    "PATH=$PATH:/usr/local/nvidia/bin; "
    "if command -v nvidia-smi >/dev/null 2>&1; then "
    "t=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0) || exit 1; "
    "else t=$(python3 -c 'import pynvml as n; n.nvmlInit(); "
    "print(n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetHandleByIndex(0)).total >> 20)') || exit 1; fi; "
    f"echo {SAMPLE_MARK} memory.total=$t"
)


#: the sample container's user (``nobody``): NVML and the shim need no root
SAMPLE_UID = 65534


def sample_pod(node: Mapping[str, Any], namespace: str, image: str, memory_mib: int, cores: int,
               timeout_s: float) -> dict[str, Any]:
    """The sample pod for ``node``: one card, ``memory_mib`` MiB, ``cores`` % (kvgpu's annotation
    form), placed by kvgpu-scheduler (``nodeSelector`` on the node's hostname label, so the
    extender and the bind run as for any GPU pod), tolerating every taint, ending by itself
    (``activeDeadlineSeconds``)."""
    meta = node.get("metadata") or {}
    host = ((meta.get("labels") or {}).get("kubernetes.io/hostname")) or str(meta.get("name", ""))
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "kvgpu-doctor-", "namespace": namespace,
                     "labels": {"app.kubernetes.io/name": "kvgpu-doctor"},
                     "annotations": {"kvgpu.io/gpu": "1", "kvgpu.io/gpumem": str(memory_mib),
                                     "kvgpu.io/gpucores": str(cores)}},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": host}, "restartPolicy": "Never",
                 "terminationGracePeriodSeconds": 1, "activeDeadlineSeconds": max(1, int(timeout_s)),
                 "tolerations": [{"operator": "Exists"}], "automountServiceAccountToken": False,
                 # PodSecurity restricted, so the check runs in a namespace of any level.
                 "securityContext": {"runAsNonRoot": True, "runAsUser": SAMPLE_UID, "runAsGroup": SAMPLE_UID,
                                     "seccompProfile": {"type": "RuntimeDefault"}},
                 "containers": [{"name": "check", "image": image, "imagePullPolicy": "IfNotPresent",
                                 "command": ["sh", "-c", SAMPLE_SCRIPT],
                                 "securityContext": {"allowPrivilegeEscalation": False,
                                                     "capabilities": {"drop": ["ALL"]}}}]},
    }


def sample_total_mib(log: str) -> int | None:
    """The memory total (MiB) the sample printed as ``KVGPU-DOCTOR memory.total=<MiB>``."""
    m = re.search(rf"{SAMPLE_MARK} memory\.total=(\d+)", log)
    return int(m.group(1)) if m else None


def check_sample(out: SampleOutcome | None, want_mib: int, timeout_s: float, namespace: str) -> Finding:
    """The sample pod ran on its node, its NVML check exited 0 and saw ``want_mib`` as the card's
    memory (the slice's limit, as the shim reports it)."""
    if out is None:
        return Finding("sample", SKIP, "not run (--no-sample)")
    if out.error:
        return _fail("sample", f"the sample pod could not be created: {out.error}",
                     f"kubectl auth can-i create pods -n {namespace}")
    evs = "; ".join(out.events[-3:])
    if out.timed_out:
        where = "never scheduled" if not out.node else f"on the node but still {out.phase or 'Pending'}"
        return _fail("sample", f"the sample pod did not finish in {timeout_s:.0f} s ({where})"
                     f"{': ' + evs if evs else ''}",
                     f"kubectl vgpu why <pod> -n {namespace} shows why a GPU pod waits; kubectl -n kvgpu-system get "
                     f"pods (is {keys.SCHEDULER_NAME} running?); or a longer --timeout")
    got = sample_total_mib(out.log)
    if out.phase != "Succeeded" or got is None:
        tail = " | ".join(out.log.strip().splitlines()[-3:]) or "no output"
        return _fail("sample", f"the sample pod {out.phase or 'failed'}: {tail}{'; ' + evs if evs else ''}",
                     "the container needs nvidia-smi or python3 with pynvml (--sample-image); the node's driver "
                     "libraries come from the agent's --driver-root")
    if got != want_mib:
        return _fail("sample", f"the sample pod saw {got} MiB, not its {want_mib} MiB limit: the shim does not "
                     "enforce in containers", "kubectl exec into a GPU pod: cat /etc/ld.so.preload must name "
                     f"{keys.CONTAINER_SHIM_LIB}; check the webhook's mounts")
    return _ok("sample", f"a {want_mib} MiB slice ran and saw {got} MiB")


# --------------------------------------------------------------------------- output


def failures(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.failed]


def line(subject: str, findings: Sequence[Finding]) -> str:
    """``NODE  OK`` or ``NODE  FAIL  <check>: <message> -> fix: <fix> | ...`` (every failure)."""
    bad = failures(findings)
    if not bad:
        return f"{subject}  OK"
    return f"{subject}  FAIL  " + " | ".join(f"{f.check}: {f.message} -> fix: {f.fix}" for f in bad)
