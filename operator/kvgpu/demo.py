"""``make demo``: the seed walk-through end to end on a real local control plane and a real node.

1. build (or reuse) the binaries: etcd, kube-apiserver, kube-scheduler, kube-controller-manager,
   kubectl and the kubelet (hack/ktp), containerd (hack/realnode);
2. start the control plane;
3. start kvgpu (CRDs, the operator, a kube-scheduler wired to its extender) and a real node:
   containerd + the kubelet (``kvgpu.devcluster.realnode``) with 4 simulated H200 cards, the
   node agent serving the kubelet's device plugin, a VGPUPool of 10 slices per card;
4. apply the seed's pod (1 card, 3000 MiB, 30 % of the SMs) in annotation and HAMi form and a
   Deployment of 6 such replicas, with the local tenant image (no registry here);
5. once the kubelet reports them Running: ``kubectl get pods/vgpupools/vgpuclaims`` and
   ``kubectl vgpu nodes``;
6. ``kubectl exec`` into the seed pod: its claim, its device node, the NVML view
   (``0MiB / 3000MiB``) and a CUDA program (the node's driver is the stub, mounted by the device
   plugin) allocating until the out-of-memory error at the limit;
7. stop everything it started, by PID, and clean the host.

Where a real node cannot run (not root, no runc), steps 4-6 run on fake nodes instead (pods
bound, not started; the CUDA process runs beside the cluster), and the demo says so.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvgpu.api.vgpuclaim import claim_phase
from kvgpu.core import keys
from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode
from kvgpu.devcluster import Cluster, ensure_binaries
from kvgpu.devcluster.cluster import REPO_ROOT, die_with_parent
from kvgpu.devcluster.fakenodes import create_nodes
from kvgpu.devcluster.realnode import RealNode, RealNodeUnavailable
from kvgpu.devcluster.system import KvgpuSystem

RUN_DIR = Path(os.environ.get("KVGPU_DEMO_DIR") or REPO_ROOT / "run" / "demo")
STUB_UUID = "GPU-5a110000-0000-0000-0000-000000000000"  # the stub driver's first card
TENANT_IMAGE = "kvgpu.local/tenant:1"
T0 = time.monotonic()


def step(n: int, total: int, text: str) -> None:
    print(f"\n\033[1m[{n}/{total}] {text}\033[0m  (+{time.monotonic() - T0:.1f} s)", flush=True)


def show(cmd: str, out: str) -> None:
    print(f"$ {cmd}")
    print(out.rstrip(), flush=True)


def fleet_file(run_dir: Path) -> Path:
    doc = {"nodes": [{"name": f"gpu-node-{i}", "cards": [{"model": "NVIDIA H200", "memoryMiB": 143771,
                                                           "smCount": 132, "numa": 0, "count": 4}]}
                     for i in range(2)]}
    path = run_dir / "fleet.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


def start_agent(c: Cluster, fleet: Path) -> subprocess.Popen[bytes]:
    log = c.log("kvgpu-agent").open("ab")
    p = subprocess.Popen(
        [sys.executable, "-m", "kvgpu.cli.main", "agent", "--fleet", f"--simulated={fleet}",
         f"--kubeconfig={c.kubeconfig}", "--interval=5"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        preexec_fn=die_with_parent, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    log.close()
    return p


def wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.3)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def pods(c: Cluster) -> list[dict[str, Any]]:
    return list(json.loads(c.kubectl("get", "pods", "-n", "default", "-o", "json").stdout)["items"])


def build_stub(out: Path) -> tuple[Path, Path]:
    """The stub CUDA driver/NVML and the cuprog test client (tests/shim), compiled with gcc."""
    out.mkdir(parents=True, exist_ok=True)
    src = REPO_ROOT / "tests" / "shim"
    cc = os.environ.get("CC", "gcc")
    for lib, c_file in (("libcuda.so.1", "stub/libcuda_stub.c"), ("libnvidia-ml.so.1", "stub/libnvml_stub.c")):
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out / lib), str(src / c_file), "-lpthread"],
                       check=True)
    subprocess.run([cc, "-O2", "-o", str(out / "cuprog"), str(src / "prog" / "cuprog.c"), f"-L{out}",
                    "-l:libcuda.so.1", "-ldl", f"-Wl,-rpath,{out}"], check=True)
    return out, out / "cuprog"


NVML_VIEW = """
import pynvml as n
n.nvmlInit()
for i in range(n.nvmlDeviceGetCount()):
    h = n.nvmlDeviceGetHandleByIndex(i)
    m = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
    print(f"  GPU {i}  {n.nvmlDeviceGetUUID(h)}  {m.used >> 20}MiB / {m.total >> 20}MiB")
"""


def run_under_shim(c: Cluster, pod: dict[str, Any]) -> None:
    ann = pod["metadata"]["annotations"]
    claim = ann[keys.claim_annotation("cuda")]
    devices = ann[keys.devices_annotation("cuda")]
    work = RUN_DIR / "shim-run"
    region = work / "region"
    region.mkdir(parents=True, exist_ok=True)
    lib = REPO_ROOT / "shim" / "_build" / "libvgpu.so"
    if not lib.exists():
        subprocess.run([sys.executable, str(REPO_ROOT / "shim" / "build.py")], check=True)
    real_gpu = shutil.which("nvidia-smi") is not None
    env = dict(os.environ)
    if real_gpu:
        uuid = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, check=True).stdout.strip()
        cuprog = None
    else:
        stub_dir, cuprog = build_stub(work / "stub")
        uuid = STUB_UUID
        env.update(LD_LIBRARY_PATH=str(stub_dir), STUB_MEM_MIB="143771", STUB_STATE=str(work / "stub.state"))
    print(f"the claim names the simulated card {devices}; on this machine the "
          f"{'real' if real_gpu else 'stub'} card {uuid} stands in for it")
    claim = claim.replace(devices, uuid)
    claim_file = work / "claim"
    claim_file.write_text(claim)  # what the downward-API volume holds
    env.update({keys.ENV_CLAIM: claim, keys.ENV_CLAIM_FILE: str(claim_file), keys.ENV_VISIBLE: uuid,
                keys.ENV_REGION_DIR: str(region), "LD_PRELOAD": str(lib)})
    print(f"  {keys.ENV_CLAIM}={claim}\n  {keys.ENV_VISIBLE}={uuid}\n  LD_PRELOAD={lib}")
    if real_gpu:
        show("nvidia-smi --query-gpu=memory.used,memory.total --format=csv",
             subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv"], env=env,
                            capture_output=True, text=True).stdout)
    show("python -c '<pynvml: nvmlDeviceGetMemoryInfo_v2, as nvidia-smi reads it>'",
         subprocess.run([sys.executable, "-c", NVML_VIEW], env=env, capture_output=True, text=True).stdout)
    if cuprog is not None:
        info = subprocess.run([str(cuprog), "info"], env=env, capture_output=True, text=True)
        show("cuprog info   # cuMemGetInfo / cuDeviceTotalMem through the shim", info.stdout + info.stderr)
        fill = subprocess.run([str(cuprog), "fill", "alloc", str(256 << 20)], env=env, capture_output=True,
                              text=True)
        show("cuprog fill alloc 256MiB   # cuMemAlloc until it fails", fill.stdout + fill.stderr)
        first = json.loads(fill.stdout.splitlines()[0])
        verdict = "CUDA_ERROR_OUT_OF_MEMORY" if first.get("rc") == 2 else f"rc={first.get('rc')}"
        print(f"-> {first['n']} blocks of 256 MiB ({first['bytes'] >> 20} MiB) fit, the next one failed "
              f"with {verdict}: the 3000 MiB limit holds")


def local_examples() -> list[dict[str, Any]]:
    """The seed's examples as they run on the real node: the local tenant image (no registry
    here), ``imagePullPolicy: Never`` and a long sleep instead of the one-shot ``nvidia-smi``;
    everything kvgpu reads (annotations, limits) as written."""
    import yaml

    docs = []
    for f in ("pod-annotations.yaml", "pod-hami.yaml", "deployment-seed.yaml"):
        doc = yaml.safe_load((REPO_ROOT / "examples" / f).read_text())
        spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]
        spec["terminationGracePeriodSeconds"] = 1
        for c in spec["containers"]:
            c.update(image=TENANT_IMAGE, imagePullPolicy="Never", command=["sleep", "infinity"])
        docs.append(doc)
    return docs


def exec_in_seed(c: Cluster, title: str, *cmd: str) -> str:
    p = c.kubectl("exec", "cuda-slice", "-c", "cuda", "--", *cmd, check=False)
    show(f"kubectl exec cuda-slice -- {title}", p.stdout + p.stderr)
    return p.stdout


def inside_the_seed_pod(c: Cluster) -> None:
    exec_in_seed(c, "sh -c 'env | grep -E \"KVGPU_CLAIM=|NVIDIA_VISIBLE\"; ls /dev | grep nvidia'",
                 "sh", "-c", "env | grep -E 'KVGPU_CLAIM=|NVIDIA_VISIBLE' | sort; ls /dev | grep nvidia")
    exec_in_seed(c, "python3 -c '<pynvml: nvmlDeviceGetMemoryInfo_v2, as nvidia-smi reads it>'",
                 "python3", "-c", NVML_VIEW)
    exec_in_seed(c, "cuprog info   # cuMemGetInfo / cuDeviceTotalMem through the shim", "cuprog", "info")
    out = exec_in_seed(c, "cuprog fill alloc 256MiB   # cuMemAlloc until it fails",
                       "cuprog", "fill", "alloc", str(256 << 20))
    first = json.loads(out.splitlines()[0])
    verdict = "CUDA_ERROR_OUT_OF_MEMORY" if first.get("rc") == 2 else f"rc={first.get('rc')}"
    print(f"-> {first['n']} blocks of 256 MiB ({first['bytes'] >> 20} MiB) fit, the next one failed "
          f"with {verdict}: the 3000 MiB limit holds inside the pod")


def show_cluster(c: Cluster) -> None:
    show("kubectl get pods -o wide", c.kubectl("get", "pods", "-o", "wide").stdout)
    show("kubectl get vgpupools", c.kubectl("get", "vgpupools").stdout)
    show("kubectl get vgpuclaims -o wide", c.kubectl("get", "vgpuclaims", "-o", "wide").stdout)
    plugin = shutil.which("kubectl-vgpu") or str(Path(sys.executable).parent / "kubectl-vgpu")
    res = subprocess.run([plugin, "--kubeconfig", str(c.kubeconfig), "nodes"], capture_output=True, text=True)
    show("kubectl vgpu nodes", res.stdout + (res.stderr if res.returncode else ""))


def claims_held(c: Cluster) -> bool:
    """Every pod's claim is there, holding its cards (no phase written: Bound)."""
    items = json.loads(c.kubectl("get", "vgpuclaims", "-o", "json").stdout)["items"]
    return len(items) >= 8 and all(claim_phase(i) == "Bound" for i in items)


def real_walkthrough(c: Cluster, node: RealNode, total: int) -> None:
    """Steps 4-6 on the real node: the pods start as containers, checked from inside."""
    step(4, total, "applying the seed's pod (annotation and HAMi form) and a Deployment of 6 replicas")
    print(f"(the examples as written, with the local image {TENANT_IMAGE} and `sleep infinity`)")
    for doc in local_examples():
        show(f"kubectl apply  # {doc['kind']} {doc['metadata']['name']}",
             c.kubectl("apply", "-f", "-", input=json.dumps(doc)).stdout)
    wait(lambda: len(p := pods(c)) >= 8 and all(x["status"].get("phase") == "Running" for x in p), 180,
         "8 pods Running on the real node")
    wait(lambda: claims_held(c), 30, "every claim holding its cards")
    step(5, total, "what the cluster shows (phases from the real kubelet)")
    show("kubectl get nodes -o wide", c.kubectl("get", "nodes", "-o", "wide").stdout)
    show_cluster(c)
    step(6, total, "inside the seed pod: kubectl exec cuda-slice")
    inside_the_seed_pod(c)


def fake_walkthrough(c: Cluster, total: int) -> subprocess.Popen[bytes]:
    """Steps 4-6 on fake nodes (no kubelet): pods bound, the shim run beside the cluster."""
    sims = [SimulatedNode(f"gpu-node-{i}", (SimulatedCardSpec(count=4),)) for i in range(2)]

    async def mk() -> None:
        async with c.api() as api:
            await create_nodes(api, sims, with_inventory=False)

    asyncio.run(mk())
    agent = start_agent(c, fleet_file(RUN_DIR))
    c.kubectl("apply", "-f", str(REPO_ROOT / "examples" / "pool.yaml"))
    wait(lambda: all(keys.NODE_INVENTORY in (n["metadata"].get("annotations") or {})
                     for n in json.loads(c.kubectl("get", "nodes", "-o", "json").stdout)["items"]),
         60, "the agent's inventory on both nodes")
    step(4, total, "applying the seed's pod (annotation and HAMi form) and a Deployment of 6 replicas")
    for f in ("pod-annotations.yaml", "pod-hami.yaml", "deployment-seed.yaml"):
        show(f"kubectl apply -f examples/{f}", c.kubectl("apply", "-f", str(REPO_ROOT / "examples" / f)).stdout)
    wait(lambda: len(p := pods(c)) >= 8 and all(x["spec"].get("nodeName") for x in p), 90, "8 pods bound")
    step(5, total, "what the cluster shows (fake nodes: no kubelet starts these pods)")
    show_cluster(c)
    step(6, total, "a CUDA process under the shim with the seed pod's claim")
    seed = next(p for p in pods(c) if p["metadata"]["name"] == "cuda-slice")
    run_under_shim(c, seed)
    return agent


def main() -> int:
    total = 7
    step(1, total, "binaries: the control plane and kubelet (hack/ktp), containerd (hack/realnode)")
    bin_dir = ensure_binaries()
    print(f"using {bin_dir}")
    if RUN_DIR.exists():
        old = RUN_DIR / "cluster.json"
        if old.exists() and any(Cluster.attach(RUN_DIR).alive().values()):
            print(f"a previous demo still runs in {RUN_DIR}; stop it with `kvgpu dev down --run-dir {RUN_DIR}`")
            return 1
        shutil.rmtree(RUN_DIR)
    step(2, total, "starting the local control plane")
    c = Cluster(run_dir=RUN_DIR, bin_dir=bin_dir)
    system = KvgpuSystem(c)
    node = RealNode(c, cards=4)
    agent: subprocess.Popen[bytes] | None = None
    real = False
    try:
        c.start()
        print(f"kube-apiserver {c.server}, logs in {RUN_DIR / 'logs'}")
        step(3, total, "kvgpu (CRDs, operator, kvgpu-scheduler) and a real node: kubelet + containerd + agent")
        system.start()
        try:
            node.start()
            real = True
        except RealNodeUnavailable as e:
            print(f"NO REAL NODE: {e}\n-> falling back to fake nodes (no containers start)")
        if real:
            node.apply_pool()
            node.start_agent()
            print(f"node {node.name}: kubelet {node.kubelet_log}, containerd {node.containerd_log}, "
                  f"agent {node.agent_log}")
            show(f"kubectl describe node {node.name} | grep nvidia.com/gpu",
                 "\n".join(ln for ln in c.kubectl("describe", "node", node.name).stdout.splitlines()
                           if "nvidia.com/gpu" in ln))
            real_walkthrough(c, node, total)
        else:
            agent = fake_walkthrough(c, total)
        step(7, total, "stopping everything this demo started")
    finally:
        if agent is not None and agent.poll() is None:
            agent.terminate()
            try:
                agent.wait(15)
            except subprocess.TimeoutExpired:
                agent.kill()
        if real:
            node.stop()
        system.stop()
        c.stop()
    print(f"done in {time.monotonic() - T0:.0f} s; nothing left running (logs kept in {RUN_DIR / 'logs'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
