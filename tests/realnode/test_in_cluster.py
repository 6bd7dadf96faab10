"""The kvgpu system itself as pods on the real node: ``helm install`` of charts/kvgpu from the product
images built here.

For this module the session's host-process system (operator, kvgpu kube-scheduler) and host agent
are stopped; :func:`kvgpu.devcluster.incluster.install_on_real_node` runs ``helm install`` with the
real node's values and the dev cluster's post-renderer (hostNetwork, API endpoint, ports, images);
at the end ``helm uninstall`` and the host-process system restarted for the other modules. Checked:
the operator's pod (uid 65532, read-only root, its child processes, the certificates it issued
itself), the agent's DaemonSet pod (device plugin registered with the real kubelet, the shim
installed), the MPS daemons' owner (kvgpu-mps: a fake daemon of an mps card outlives a killed agent
container and is kept, not started again), kube-scheduler from the ktp binary, the seed pod
(examples/deployment-seed.yaml: 1 card, 3000 MiB, 30 %) scheduled by that scheduler through the
in-cluster extender, running on the real node and seeing its slice, whose memory the agent's
metrics report from the region; while that pod's process maps the shim, a rebuilt shim installed
beside it (the process keeps its file and bytes); ``kubectl vgpu doctor`` passing, ``top`` showing
usage, doctor naming a shim removed from the node and passing again after its fix; and ``helm
upgrade`` from the chart of the previous commit with a sliced pod running: the claim, the container
and its limit kept, and new pods placed by the upgraded system.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvgpu.agent import mps, shiminstall
from kvgpu.core import keys
from kvgpu.core.inventory import NodeInventory
from kvgpu.devcluster import incluster
from kvgpu.devcluster.images import REPO_ROOT
from kvgpu.devcluster.realnode import SHIM_SOURCE, RealNode
from kvgpu.devcluster.system import KvgpuSystem
from realnode.conftest import RealPods
from realnode.gpupods import container, gpu_pod, hami_limits, wait_for
from realnode.test_doctor_top import doctor_top_and_a_removed_shim, vgpu

MIB = 1 << 20
NS = incluster.NAMESPACE


@pytest.fixture(scope="module")
def system(real_node: RealNode, kvgpu_system: KvgpuSystem) -> Iterator[incluster.InstalledSystem]:
    real_node.stop_agent()
    kvgpu_system.stop()
    t = time.monotonic()
    installed = None
    try:
        installed = incluster.install_on_real_node(real_node)
        print(f"\n[kvgpu] helm install: the in-cluster system rolled out in {time.monotonic() - t:.1f} s")
        yield installed
    finally:
        if installed is not None:
            incluster.uninstall_from_real_node(real_node.cluster, installed)
        kvgpu_system.install_device_classes()  # Helm's went with the release
        kvgpu_system.start_operator()
        kvgpu_system.start_scheduler()
        real_node.start_agent()


def _pod_of(cluster: Any, component: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "pods", "-n", NS, "-l", f"app.kubernetes.io/component={component}",
                          "-o", "json").stdout
    [pod] = json.loads(out)["items"]
    return dict(pod)


def _exec(cluster: Any, pod: str, *cmd: str) -> str:
    return str(cluster.kubectl("exec", pod, "-n", NS, "--", *cmd).stdout)


def test_operator_pod_and_its_children(real_node: RealNode, system: incluster.InstalledSystem) -> None:
    c = real_node.cluster
    pod = _pod_of(c, "operator")
    assert pod["spec"]["nodeName"] == real_node.name and pod["spec"]["hostNetwork"] is True
    assert pod["spec"]["containers"][0]["image"] == system.values.operator_image
    name = pod["metadata"]["name"]
    assert _exec(c, name, "sh", "-c", "id -u; id -g").split() == ["65532", "65532"]
    assert _exec(c, name, "awk", '$2=="/"{print $4}', "/proc/mounts").startswith("ro")
    # the processes of the container: main + 2 admission workers + the claim-phase worker (leader)
    comms = _exec(c, name, "sh", "-c", "cat /proc/[0-9]*/comm").split()
    assert comms.count("kvgpu-webhook") == 2, comms
    assert comms.count("kvgpu-phases") == 1, comms
    # the operator answers on its metrics port (hostNetwork: the host's port)
    with urllib.request.urlopen(f"{system.operator_metrics_url}/readyz", timeout=5) as r:
        assert r.status == 200


def test_agent_daemonset_pod(real_node: RealNode, system: incluster.InstalledSystem) -> None:
    c = real_node.cluster
    pod = _pod_of(c, "agent")
    assert pod["spec"]["nodeName"] == real_node.name
    assert pod["spec"]["containers"][0]["image"] == system.values.agent_image
    mounts = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["spec"]["volumes"]}
    assert mounts["device-plugins"] == "/var/lib/kubelet/device-plugins" and mounts["shim"] == "/usr/local/kvgpu"
    # the device plugin registered with the real kubelet, the shim installed from the image
    node = json.loads(c.kubectl("get", "node", real_node.name, "-o", "json").stdout)
    assert int(node["status"]["allocatable"].get("nvidia.com/gpu", "0")) > 0
    lib = _exec(c, pod["metadata"]["name"], "readlink", "/usr/local/kvgpu/lib/libvgpu.so").strip()
    assert lib.startswith("libvgpu.so."), lib


MPS_CARD = 2  # the card of the test's mps pool


@pytest.fixture
def mps_card(real_node: RealNode, system: incluster.InstalledSystem) -> Iterator[str]:
    """A VGPUPool with ``mode: mps`` over one card of the node, and the unit tests' fake
    ``nvidia-cuda-mps-control`` in the simulated driver folder, where the kvgpu-mps pod looks
    for it (run by the image's Python); the card's UUID."""
    from unit.test_agent_mps import FAKE

    bin_dir = real_node.driver_root / "bin"
    made_bin = not bin_dir.exists()
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / mps.CONTROL
    fake.write_text(FAKE.replace("#!PYTHON", "#!/usr/local/bin/python3"))
    fake.chmod(0o755)
    pool = f"{real_node.pool_name}-mps"
    labels = {"kvgpu.io/gpu-node": "true", "kubernetes.io/hostname": real_node.name}
    real_node.cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": pool},
        "spec": {"nodeSelector": {"matchLabels": labels}, "devices": {"indexes": [MPS_CARD]},
                 "splitCount": 4, "mode": "mps"}}))
    root = Path(keys.HOST_MPS_ROOT)
    try:
        def card() -> str | None:
            ann = ((real_node.node() or {}).get("metadata", {}).get("annotations") or {}).get(keys.NODE_INVENTORY)
            inv = NodeInventory.loads(ann) if ann else None
            return next((c.uuid for c in (inv.cards if inv else ()) if c.index == MPS_CARD and c.slicing
                         and c.slicing.mode == "mps"), None)

        uuid = wait_for(card, 60, f"card {MPS_CARD} in the mps pool")
        yield str(uuid)
    finally:
        real_node.cluster.kubectl("delete", "vgpupool", pool, "--ignore-not-found")
        wait_for(lambda: _wanted(root) == [], 60, "the agent's wanted.json without the card")
        fake.unlink()
        if made_bin:
            bin_dir.rmdir()


def _wanted(root: Path) -> list[str] | None:
    try:
        return mps.parse_wanted((root / mps.WANTED_FILE).read_text())
    except OSError:
        return None


def _container_state(cluster: Any, component: str) -> tuple[str, int, bool]:
    """The first container of the component's pod: containerd ID, restart count, ready."""
    st = _pod_of(cluster, component)["status"]["containerStatuses"][0]
    return st.get("containerID", "").removeprefix("containerd://"), int(st["restartCount"]), bool(st["ready"])


def test_mps_daemons_survive_an_agent_container_restart(real_node: RealNode, mps_card: str) -> None:
    """The agent names the mps card in wanted.json, the kvgpu-mps pod starts its (fake) daemon;
    the agent's container killed and restarted by the kubelet leaves the daemon running, and the
    new agent keeps it: no second start, the owner's status fresh and alive (what Allocate checks)."""
    c = real_node.cluster
    root = Path(keys.HOST_MPS_ROOT)
    try:
        wait_for(lambda: mps.check_ready(root, mps_card) is None, 60, "the kvgpu-mps pod's daemon for the card")
    except AssertionError as e:
        pod = _pod_of(c, "mps")["metadata"]["name"]
        logs = c.kubectl("logs", pod, "-n", NS, "--tail=30", check=False)
        raise AssertionError(f"{e}: {mps.check_ready(root, mps_card)}\n{logs.stdout}{logs.stderr}") from e
    log = root / mps_card / "log" / "control.log"
    started = log.read_text()
    assert started.split()[1] == mps_card and len(started.splitlines()) == 1
    owner = _container_state(c, "mps")
    cid, restarts, _ = _container_state(c, "agent")
    real_node.ctr("tasks", "kill", "-s", "SIGKILL", cid)  # the agent's container ends: a crash
    wait_for(lambda: (s := _container_state(c, "agent"))[1] > restarts and s[2], 120,
             "the agent's container restarted by the kubelet and ready")
    t = mps.read_status(root).time  # type: ignore[union-attr]
    wait_for(lambda: (mps.read_status(root) or mps.Status(0, 0, {})).time > t + 5, 30, "two more owner rounds")
    assert mps.check_ready(root, mps_card) is None
    assert log.read_text() == started, "the daemon was started again"
    with socket.socket(socket.AF_UNIX) as s:  # the daemon itself answers
        s.connect(str(mps.pipe_dir(root, mps_card) / "control"))
        s.sendall(b"get_server_list")
        assert s.recv(10) == b""
    assert _container_state(c, "mps") == owner, "the owner's container was not restarted"
    assert _wanted(root) == [mps_card]


def test_scheduler_is_the_ktp_binary(real_node: RealNode, system: incluster.InstalledSystem) -> None:
    pod = _pod_of(real_node.cluster, "scheduler")
    assert pod["spec"]["containers"][0]["image"] == system.values.scheduler_image
    assert system.values.scheduler_image.startswith("kvgpu.local/kube-scheduler:v1.")


def _seed_pod(ns: str, node: str) -> dict[str, Any]:
    """One replica of examples/deployment-seed.yaml's template, with the tenant image."""
    dep = yaml.safe_load((REPO_ROOT / "examples" / "deployment-seed.yaml").read_text())
    tpl = dep["spec"]["template"]
    [ctr] = tpl["spec"]["containers"]
    ctr.update(image="kvgpu.local/tenant:1", imagePullPolicy="Never", command=["sleep", "3600"])
    spec = {**tpl["spec"], "nodeSelector": {"kubernetes.io/hostname": node}, "terminationGracePeriodSeconds": 1}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "seed", "namespace": ns,
                                                          "annotations": tpl["metadata"]["annotations"]},
            "spec": spec}


def _metric(url: str, name_re: str, pod: str) -> float | None:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if re.match(name_re, line) and f'pod="{pod}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_seed_pod_through_the_in_cluster_scheduler(real_pods: RealPods, system: incluster.InstalledSystem) -> None:
    rp = real_pods
    rp.apply(_seed_pod(rp.ns, rp.node.name))
    pod = rp.wait_running("seed", timeout=120)
    assert pod["spec"]["schedulerName"] == "kvgpu-scheduler"  # the in-cluster webhook set it
    assert pod["spec"]["nodeName"] == rp.node.name
    events = json.loads(rp.cluster.kubectl("get", "events", "-n", rp.ns, "-o", "json",
                                           "--field-selector=involvedObject.name=seed").stdout)["items"]
    assert any(e.get("reportingComponent") == "kvgpu-scheduler" or
               e.get("source", {}).get("component") == "kvgpu-scheduler" for e in events), events
    # the extender's bind (the profile's bindVerb) made the pod's claim: the in-cluster operator's
    claims = json.loads(rp.cluster.kubectl("get", "vgpuclaims", "-n", rp.ns, "-o", "json").stdout)["items"]
    assert [(c["spec"]["podName"], c["spec"]["node"]) for c in claims] == [("seed", rp.node.name)], claims
    info = json.loads(rp.exec("seed", "sh", "-c", "cuprog info").splitlines()[0])
    assert info["rc"] == 0 and info["total"] == 3000 * MIB, info
    # memory allocated through the stub driver, held, and read by the agent from the region
    rp.exec("seed", "sh", "-c", f"(cuprog fill alloc {512 * MIB} 1 60 >/tmp/hold.json 2>&1 &) ; sleep 1")
    deadline = time.monotonic() + 30
    used = None
    while time.monotonic() < deadline:
        used = _metric(system.agent_metrics_url, r"^(kvgpu_container_memory_used_bytes|vGPU_device_memory_usage)",
                       "seed")
        if used and used >= 512 * MIB:
            break
        time.sleep(1)
    assert used is not None and used >= 512 * MIB, used
    _shim_upgrade_keeps_the_mapped_file()


def _mapping_pids(path_prefix: str) -> dict[int, str]:
    """Host PID -> the file under ``path_prefix`` it maps (from /proc/<pid>/maps; root here)."""
    out: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for line in (d / "maps").read_text().splitlines():
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(path_prefix):
                    out[int(d.name)] = parts[5]
        except OSError:
            continue
    return out


def _shim_upgrade_keeps_the_mapped_file() -> None:
    """An agent upgrade installs a rebuild of the same version (other bytes) while the seed
    pod's process maps the shim: that process keeps its file, name and bytes, the link moves."""
    lib_dir = Path(keys.HOST_SHIM_DIR)
    mapped = _mapping_pids(str(lib_dir) + "/")
    assert mapped, "no process maps the installed shim"
    pid, name = next(iter(mapped.items()))
    assert not name.endswith("(deleted)"), name
    before = shiminstall.sha256_file(Path(name))
    rebuilt = Path(tempfile.mkdtemp()) / "libvgpu.so"
    rebuilt.write_bytes(SHIM_SOURCE.read_bytes() + b"\0rebuilt")
    r = shiminstall.install_shim(rebuilt, "0.1.0", lib_dir, None)
    assert r.action == "beside" and r.switched, r
    maps = (Path("/proc") / str(pid) / "maps").read_text()
    assert name in maps and f"{name} (deleted)" not in maps
    assert shiminstall.sha256_file(Path(name)) == before
    assert (lib_dir / "libvgpu.so").resolve() == r.path
    # back to the image's build (the name it had: unchanged, the link switched back)
    back = shiminstall.install_shim(SHIM_SOURCE, "0.1.0", lib_dir, None)
    assert back.action == "unchanged" and str(back.path) == name


def test_doctor_and_top_against_the_installed_chart(real_pods: RealPods, system: incluster.InstalledSystem) -> None:
    """The post-install check as a user runs it after ``helm install``: every check real (the
    operator's StatefulSet, the scheduler, the caBundle the operator issued, the agent's own
    DaemonSet pod), then the shim fault, then its fix: doctor's own advice."""
    agent = _pod_of(real_pods.cluster, "agent")["metadata"]["name"]
    doctor_top_and_a_removed_shim(real_pods, agent)
    real_pods.cluster.kubectl("delete", "pod", agent, "-n", NS, "--wait=true", "--timeout=60s")
    node = real_pods.node
    args = (node.name, "-n", real_pods.ns, "--sample-image", node.image("tenant"), "--timeout", "90")
    fixed = wait_for(lambda: (p := vgpu(node, "doctor", *args)).returncode == 0 and p, 120,
                     "doctor passing again after the agent pod was replaced")
    assert fixed.stdout.splitlines() == ["cluster  OK", f"{node.name}  OK"], fixed.stdout


def _previous_chart(dest: Path) -> Path | None:
    """charts/kvgpu as the previous commit had it (``$KVGPU_UPGRADE_FROM`` names another), or
    None where that commit had no chart."""
    rev = os.environ.get("KVGPU_UPGRADE_FROM", "HEAD~1")
    tar = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", rev, "charts/kvgpu"], capture_output=True,
                         check=False)
    if tar.returncode != 0:
        return None
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar.stdout, check=True)
    return dest / "charts" / "kvgpu"


def _claims(rp: RealPods) -> list[dict[str, Any]]:
    out = json.loads(rp.cluster.kubectl("get", "vgpuclaims", "-n", rp.ns, "-o", "json").stdout)["items"]
    return sorted(out, key=lambda c: c["metadata"]["name"])


def _kvgpu_pods(node: RealNode) -> set[str]:
    """UIDs of the operator's and the agent's pods."""
    out = node.cluster.kubectl("get", "pods", "-n", NS, "-l", "app.kubernetes.io/component in (operator,agent)",
                               "-o", "json").stdout
    return {p["metadata"]["uid"] for p in json.loads(out)["items"]}


def _operator_serving(system: incluster.InstalledSystem, steady_s: float = 5.0, timeout: float = 90) -> None:
    """The operator's ``/readyz`` answering 200 for ``steady_s`` in a row. ``helm upgrade --wait``
    can return while the operator pod is Ready and yet about to drop its listeners for a few
    seconds (seen right after the upgrade to the previous chart: ``/readyz`` and the webhook
    refused, then 503 while it stood by), and a pod created then is refused by the webhook."""
    deadline, since = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{system.operator_metrics_url}/readyz", timeout=2) as r:
                ok = r.status == 200
        except OSError:
            ok = False
        since = (since or time.monotonic()) if ok else None
        if since is not None and time.monotonic() - since >= steady_s:
            return
        time.sleep(0.5)
    raise AssertionError(f"the operator did not serve steadily within {timeout} s")


def test_helm_upgrade_from_the_previous_chart_keeps_running_slices(
        real_node: RealNode, real_pods: RealPods, system: incluster.InstalledSystem, tmp_path: Path) -> None:
    rp = real_pods
    previous = _previous_chart(tmp_path)
    if previous is None:
        pytest.skip("the previous commit has no charts/kvgpu")
    # the release as the previous commit's chart makes it, a sliced pod running under it
    incluster.upgrade_on_real_node(real_node, system, chart=previous)
    _operator_serving(system)
    rp.apply(gpu_pod(rp, "held", containers=[container("main", hami_limits(1, 1500, 20))]))
    before = rp.wait_running("held", timeout=120)
    claims = _claims(rp)
    view = rp.exec("held", "sh", "-c", "cuprog info").splitlines()[0]
    pods_before = _kvgpu_pods(real_node)
    # to this commit's chart, the operator's and the agent's pods replaced (a changed pod template)
    marker = {"kvgpu.io/upgrade-test": str(time.time())}
    incluster.upgrade_on_real_node(real_node, system, extra={"operator": {"podAnnotations": marker},
                                                             "devicePlugin": {"podAnnotations": marker}})
    pods_after = _kvgpu_pods(real_node)
    assert not pods_before & pods_after, "the upgrade left an operator or agent pod in place"
    _operator_serving(system)
    after = rp.get("held")
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    [st] = after["status"]["containerStatuses"]
    assert st["restartCount"] == 0 and "running" in st["state"], st
    assert st["containerID"] == before["status"]["containerStatuses"][0]["containerID"]
    assert [(c["metadata"]["uid"], c["spec"]) for c in _claims(rp)] == [(c["metadata"]["uid"], c["spec"])
                                                                         for c in claims]
    assert rp.exec("held", "sh", "-c", "cuprog info").splitlines()[0] == view  # the same limit, seen alike
    assert json.loads(view)["total"] == 1500 * MIB
    # the upgraded system places new slices
    rp.apply(gpu_pod(rp, "after", containers=[container("main", hami_limits(1, 1000, 10))]))
    rp.wait_running("after", timeout=120)
    assert json.loads(rp.exec("after", "sh", "-c", "cuprog info").splitlines()[0])["total"] == 1000 * MIB
