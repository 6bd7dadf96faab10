"""Control-plane integrity (issue 22, item 1) on the real API server: every path that changes
what a pod holds is guarded. Each case plays a namespace admin with wider roles than tenants
usually get (``mallory``: every verb on pods, their status and ephemeral containers, and on
VGPUClaims and their status, in the test namespace), or a cluster admin where that is the
point, and asserts that the write is refused or undone.

Fake GPU nodes have no kubelet: the tests patch pod status where a kubelet would (as the
cluster admin, who is not the operator either)."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from typing import Any

import pytest
from kvgpu.api.vgpuclaim import claim_phase

from tests.cluster.conftest import GpuEnv, gpu

__all__ = ["gpu"]

MALLORY = "mallory"
SLICE = {"kvgpu.io/gpumem": "6000", "kvgpu.io/gpucores": "30"}


def _grant_mallory(env: GpuEnv) -> None:
    env.apply(
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "mallory", "namespace": env.ns},
         "rules": [
             {"apiGroups": [""], "resources": ["pods", "pods/status", "pods/ephemeralcontainers"],
              "verbs": ["*"]},
             {"apiGroups": ["kvgpu.io"], "resources": ["vgpuclaims", "vgpuclaims/status"], "verbs": ["*"]},
         ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "mallory", "namespace": env.ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "mallory"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": MALLORY}]},
    )


def _as(env: GpuEnv, user: str, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return env.cluster.kubectl(f"--as={user}", *args, input=input, check=False)


def _running(env: GpuEnv, name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    env.create(env.pod(name, annotations or SLICE))
    env.wait_bound(name)
    env.mark_running(name)
    env.wait(lambda: _holds(_claim_of(env, name)), what=f"{name}'s claim holding its cards")
    return env.get("pod", name)  # type: ignore[no-any-return]


def _holds(claim: dict[str, Any] | None) -> bool:
    """The claim exists and holds its cards: no phase written (Bound), not Released."""
    return claim is not None and claim_phase(claim) == "Bound"


def _claim_of(env: GpuEnv, pod: str) -> dict[str, Any] | None:
    return next((c for c in env.claims() if c["spec"]["podName"] == pod), None)


def _refused(p: subprocess.CompletedProcess[str], *words: str) -> None:
    assert p.returncode != 0, f"the write was admitted: {p.stdout}"
    for w in words:
        assert w in p.stderr, p.stderr


def _status_patch(env: GpuEnv, user: str, pod: str, body: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return _as(env, user, "patch", "pod", pod, "-n", env.ns, "--subresource=status", "--type=merge",
               "-p", json.dumps(body))


# --------------------------------------------------------------------------- pod metadata


def test_status_subresource_cannot_point_claims_at_a_victim(gpu: GpuEnv) -> None:
    """The measured hole: an ended pod's ``kvgpu.io/claims`` patched through ``pods/status`` to
    name a running victim's claim, which the claim-phase worker then Released."""
    _grant_mallory(gpu)
    gpu.nodes(1, cards=1, memory_mib=10000)
    _running(gpu, "victim")
    victim_claim = _claim_of(gpu, "victim")
    assert victim_claim is not None
    gpu.create(gpu.pod("ended", {"kvgpu.io/gpumem": "1000"}))
    gpu.wait_bound("ended")
    p = _status_patch(gpu, MALLORY, "ended",
                      {"metadata": {"annotations": {"kvgpu.io/claims": victim_claim["metadata"]["name"]}}})
    _refused(p, "kvgpu.io/claims", "only be changed by the kvgpu operator")
    # The kubelet's ordinary status writes still pass (and are not sent to the webhook at all).
    assert _status_patch(gpu, MALLORY, "ended", {"status": {"phase": "Succeeded"}}).returncode == 0
    time.sleep(3)
    claim = _claim_of(gpu, "victim")
    assert _holds(claim), claim


@pytest.mark.parametrize("subresource", [False, True], ids=["pod", "status"])
def test_managed_label_cannot_be_removed(gpu: GpuEnv, subresource: bool) -> None:
    """Removing ``kvgpu.io/managed`` deleted a Running pod's claim within 3 s."""
    _grant_mallory(gpu)
    gpu.nodes(1, cards=1)
    _running(gpu, "lab")
    if subresource:
        p = _status_patch(gpu, MALLORY, "lab", {"metadata": {"labels": {"kvgpu.io/managed": None}}})
    else:
        p = _as(gpu, MALLORY, "label", "pod", "lab", "-n", gpu.ns, "kvgpu.io/managed-")
    _refused(p, "kvgpu.io/managed", "only be changed by the kvgpu operator")
    time.sleep(4)
    claim = _claim_of(gpu, "lab")
    assert _holds(claim), claim


def test_claim_string_cannot_be_rewritten_to_a_full_card(gpu: GpuEnv) -> None:
    _grant_mallory(gpu)
    gpu.nodes(1, cards=1)
    pod = _running(gpu, "cs")
    key = "kvgpu.io/claim.main"
    forged = pod["metadata"]["annotations"][key].replace(",6000,30", ",10000,100")
    assert forged != pod["metadata"]["annotations"][key]
    for args in (["--subresource=status"], []):
        p = _as(gpu, MALLORY, "patch", "pod", "cs", "-n", gpu.ns, *args, "--type=merge",
                "-p", json.dumps({"metadata": {"annotations": {key: forged}}}))
        _refused(p, key)
    assert gpu.get("pod", "cs")["metadata"]["annotations"][key] == pod["metadata"]["annotations"][key]


# --------------------------------------------------------------------------- privileges


@pytest.mark.parametrize(("change", "words"), [
    (lambda p: p["spec"].update(hostPID=True), ["hostPID"]),
    (lambda p: p["spec"].update(volumes=[{"name": "root", "hostPath": {"path": "/"}}]), ["'root'", "'/'"]),
    (lambda p: p["spec"].update(volumes=[{"name": "dev", "hostPath": {"path": "/dev"}}]), ["'dev'"]),
    (lambda p: p["spec"]["containers"][0].update(securityContext={"capabilities": {"add": ["SYS_PTRACE"]}}),
     ["SYS_PTRACE"]),
], ids=["hostPID", "hostPath-root", "hostPath-dev", "SYS_PTRACE"])
def test_privileges_are_refused_for_sliced_pods(gpu: GpuEnv, change: Any, words: list[str]) -> None:
    body = gpu.pod("priv", SLICE)
    change(body)
    p = gpu.cluster.kubectl("create", "-f", "-", input=json.dumps(body), check=False)
    _refused(p, *words)


@pytest.mark.parametrize("profile", ["sysadmin", "general"])
def test_privileged_debug_container_is_refused(gpu: GpuEnv, profile: str) -> None:
    """``kubectl debug <gpu pod> --profile=sysadmin`` added a privileged container to a sliced pod."""
    gpu.nodes(1, cards=1)
    _running(gpu, "dbg")
    p = gpu.cluster.kubectl("debug", "dbg", "-n", gpu.ns, "--image=busybox", f"--profile={profile}",
                            "--container=debugger", "--", "sleep", "1", check=False)
    _refused(p, "ephemeral container 'debugger'", "--profile=baseline")
    assert not gpu.get("pod", "dbg")["spec"].get("ephemeralContainers")
    ok = gpu.cluster.kubectl("debug", "dbg", "-n", gpu.ns, "--image=busybox", "--profile=baseline",
                             "--container=looker", "--", "sleep", "1", check=False)
    assert ok.returncode == 0, ok.stderr


# --------------------------------------------------------------------------- claims


def test_claims_are_written_by_the_operator_only(gpu: GpuEnv) -> None:
    """A VGPUClaim set Released or deleted by a user freed a running pod's slice for good (186771
    MiB promised on a 143771 MiB card)."""
    _grant_mallory(gpu)
    gpu.nodes(1, cards=1)
    _running(gpu, "held")
    claim = _claim_of(gpu, "held")
    assert claim is not None
    name = claim["metadata"]["name"]
    p = _as(gpu, MALLORY, "patch", "vgpuclaim", name, "-n", gpu.ns, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": {"phase": "Released"}}))
    _refused(p, "written by the kvgpu operator only")
    _refused(_as(gpu, MALLORY, "delete", "vgpuclaim", name, "-n", gpu.ns, "--wait=false"),
             "written by the kvgpu operator only")
    forged = {k: v for k, v in claim.items() if k not in ("status",)}
    forged["metadata"] = {"name": f"forged-{uuid.uuid4().hex[:6]}", "namespace": gpu.ns}
    _refused(_as(gpu, MALLORY, "create", "-f", "-", input=json.dumps(forged)), "written by the kvgpu operator only")
    # Reading them is what tenants may do.
    assert _as(gpu, MALLORY, "get", "vgpuclaims", "-n", gpu.ns).returncode == 0
    assert _holds(_claim_of(gpu, "held"))


def test_phase_worker_releases_only_claims_of_the_pod(gpu: GpuEnv) -> None:
    """Even where ``kvgpu.io/claims`` of an ending pod names another pod's claim (written here
    as the operator's identity, which admission lets through), the claim-phase worker releases
    only claims whose ``spec.podUID`` is the pod's."""
    gpu.nodes(1, cards=1, memory_mib=10000)
    _running(gpu, "victim")
    victim_claim = _claim_of(gpu, "victim")
    assert victim_claim is not None
    gpu.create(gpu.pod("ender", {"kvgpu.io/gpumem": "1000"}))
    gpu.wait_bound("ender")
    own = _claim_of(gpu, "ender")
    assert own is not None
    names = f"{own['metadata']['name']},{victim_claim['metadata']['name']}"
    p = _as(gpu, "kvgpu-operator", "--as-group=system:masters", "annotate", "pod", "ender", "-n", gpu.ns,
            "--overwrite", f"kvgpu.io/claims={names}")
    assert p.returncode == 0, p.stderr
    gpu.cluster.kubectl("patch", "pod", "ender", "-n", gpu.ns, "--subresource=status", "--type=merge",
                        "-p", json.dumps({"status": {"phase": "Succeeded"}}))
    gpu.wait(lambda: (c := _claim_of(gpu, "ender")) is not None and c.get("status", {}).get("phase") == "Released",
             what="the ender's own claim Released")
    time.sleep(2)
    claim = _claim_of(gpu, "victim")
    assert _holds(claim), claim
