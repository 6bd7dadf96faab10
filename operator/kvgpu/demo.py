"""``make demo``: the seed walk-through end to end on a real local control plane.

1. build (or reuse) the control-plane binary; start etcd, kube-apiserver, kube-controller-manager
   and kube-scheduler;
2. start kvgpu: CRDs, the operator (extender, admission webhooks, reconcilers) as its own
   process, a second kube-scheduler wired to the extender, and the node agent in simulated mode
   for 2 fake GPU nodes × 4 H200 cards (it publishes their inventory);
3. apply a VGPUPool (10 slices per card) and the examples: the seed's pod (1 card, 3000 MiB,
   30 % cores) in annotation form and in HAMi resource form, a Deployment of 6 replicas;
4. print ``kubectl get vgpupools``, ``kubectl get vgpuclaims -o wide`` and ``kubectl vgpu nodes``;
5. run a CUDA process under the shim with the env and claim file exactly as the operator wrote
   them for the seed pod — against the stub driver on a CPU machine, the real card when
   ``nvidia-smi`` is present — and show the memory view (``0MiB / 3000MiB``) and the OOM;
6. stop everything it started, by PID.
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

from kvgpu.core import keys
from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode
from kvgpu.devcluster import Cluster, ensure_binaries
from kvgpu.devcluster.cluster import REPO_ROOT, die_with_parent
from kvgpu.devcluster.fakenodes import create_nodes
from kvgpu.devcluster.system import KvgpuSystem

RUN_DIR = Path(os.environ.get("KVGPU_DEMO_DIR") or REPO_ROOT / "run" / "demo")
STUB_UUID = "GPU-5a110000-0000-0000-0000-000000000000"  # the stub driver's first card
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


def main() -> int:
    total = 7
    step(1, total, "control-plane binary (etcd, kube-apiserver, kube-scheduler, KCM, kubectl)")
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
    agent: subprocess.Popen[bytes] | None = None
    try:
        c.start()
        print(f"kube-apiserver {c.server}, logs in {RUN_DIR / 'logs'}")
        step(3, total, "kvgpu: CRDs, operator (extender + webhooks + reconcilers), kvgpu-scheduler, agent")
        system.start()
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
        show("kubectl get nodes -L kvgpu.io/gpu-node,nvidia.com/gpu.product",
             c.kubectl("get", "nodes", "-L", "kvgpu.io/gpu-node,nvidia.com/gpu.product").stdout)
        show("kubectl get nodes -o custom-columns=NAME:.metadata.name,VGPUS:.status.allocatable.nvidia\\.com/gpu",
             c.kubectl("get", "nodes", "-o",
                       "custom-columns=NAME:.metadata.name,VGPUS:.status.allocatable.nvidia\\.com/gpu").stdout)

        step(4, total, "applying the seed's pod (annotation and HAMi form) and a Deployment of 6 replicas")
        for f in ("pod-annotations.yaml", "pod-hami.yaml", "deployment-seed.yaml"):
            show(f"kubectl apply -f examples/{f}", c.kubectl("apply", "-f", str(REPO_ROOT / "examples" / f)).stdout)
        wait(lambda: len(p := pods(c)) >= 8 and all(x["spec"].get("nodeName") for x in p), 90, "8 pods bound")
        for p in pods(c):  # play the kubelet: the pods start
            c.kubectl("patch", "pod", p["metadata"]["name"], "--subresource=status", "--type=merge",
                      "-p", json.dumps({"status": {"phase": "Running"}}))

        step(5, total, "what the cluster shows")
        time.sleep(2.0)
        show("kubectl get pods -o wide", c.kubectl("get", "pods", "-o", "wide").stdout)
        show("kubectl get vgpupools", c.kubectl("get", "vgpupools").stdout)
        show("kubectl get vgpuclaims -o wide", c.kubectl("get", "vgpuclaims", "-o", "wide").stdout)
        plugin = shutil.which("kubectl-vgpu") or str(Path(sys.executable).parent / "kubectl-vgpu")
        res = subprocess.run([plugin, "--kubeconfig", str(c.kubeconfig), "nodes"], capture_output=True, text=True)
        show("kubectl vgpu nodes", res.stdout + (res.stderr if res.returncode else ""))

        step(6, total, "a CUDA process under the shim with the seed pod's claim")
        seed = next(p for p in pods(c) if p["metadata"]["name"] == "cuda-slice")
        run_under_shim(c, seed)
        step(7, total, "stopping everything this demo started")
    finally:
        if agent is not None and agent.poll() is None:
            agent.terminate()
            try:
                agent.wait(15)
            except subprocess.TimeoutExpired:
                agent.kill()
        system.stop()
        c.stop()
    print(f"done in {time.monotonic() - T0:.0f} s; nothing left running (logs kept in {RUN_DIR / 'logs'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
