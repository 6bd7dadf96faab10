"""The MPS part of the real-node run on the GPU machine (bench/gpu/realnode_run.py --parts mps).

``--parts mps`` (the MPS backend, issue 21): the agent runs with ``--mps-daemons=separate`` and
the daemons' owner runs as a pod, the chart's ``kvgpu-mps`` container (``kvgpu mps-daemons``,
root with only ``SETUID``/``SETGID``, read-only root file system, RuntimeDefault seccomp, the MPS
root hostPath); as a bare Pod bound to the node on the host network, with the machine's Python
folders mounted, and the NVIDIA runtime it names replaced by
:class:`~kvgpu.devcluster.runtimeplugin.RuntimePlugin` (every card's device node and the driver
folders, from a device plugin: the machine has no NVIDIA container toolkit). The node's card
becomes an mps pool; once the owner's ``status.json`` says its daemon answers, two sliced pods
(3000 MiB / 30 %, and 4000 MiB / 50 % whose pod spec sets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100``,
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=100G`` and ``CUDA_MPS_PIPE_DIRECTORY=/tmp``) run on the card.
Checked: the owner's capabilities (``CapEff`` = SETUID|SETGID) and read-only root, its daemon in
its pod's cgroup; in each pod ``nvidia-smi`` shows the slice's memory total, the three variables
after CUDA started are the claim's (``bench/gpu/mps_env.py``), torch stops at
``torch.OutOfMemoryError`` below the claim; both pods' matmul loops at once, each within 10
points of its thread percentage of the native loop; ``nvidia-smi`` on the host meanwhile lists
``nvidia-cuda-mps-server`` and the two clients as ``M+C``; the owner's status fresh at the end.
The daemons' control and server logs are printed at the end of the part.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvgpu.agent import mps as mpsd
from kvgpu.core import keys
from kvgpu.demo import wait
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.cluster import REPO_ROOT
from kvgpu.devcluster.realnode import RealNode
from kvgpu.devcluster.runtimeplugin import RESOURCE as RUNTIME_RESOURCE
from kvgpu.devcluster.runtimeplugin import RuntimePlugin
from realnode_kit import HOST_USR, TORCH_PY, matmul, memtest, say, seed_pod, show

# ----- part mps: the MPS backend with its daemons' owner as a pod (issue 21) -----------------------
MPS_ROOT = Path(keys.HOST_MPS_ROOT)
MPS_OWNER = "kvgpu-mps"
# kube-system: a namespace kvgpu's webhooks never see, as the chart's kvgpu-system is for its operator
MPS_OWNER_NS = "kube-system"
#: the tenants: (pod, MiB, cores); the second sets the MPS variables itself, bigger than its claim
MPS_TENANTS = (("mps-a", 3000, 30), ("mps-b", 4000, 50))
MPS_FORGED_ENV = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=100G",
                  "CUDA_MPS_PIPE_DIRECTORY": "/tmp"}
#: charts/kvgpu/templates/mps.yaml, the kvgpu-mps container's securityContext
MPS_OWNER_SECURITY = {"runAsUser": 0, "privileged": False, "allowPrivilegeEscalation": False,
                      "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"], "add": ["SETUID", "SETGID"]},
                      "seccompProfile": {"type": "RuntimeDefault"}}
#: CapEff of a root process with only CAP_SETGID (6) and CAP_SETUID (7)
SETUID_SETGID_CAPS = f"{(1 << 6) | (1 << 7):016x}"


def _python_dirs() -> list[str]:
    """The sys.path folders (besides the standard library's) that ``kvgpu mps-daemons`` imports
    from, asked of a fresh interpreter with this process's environment."""
    code = """if True:
        import sys, sysconfig
        from pathlib import Path
        import kvgpu.cli.main, kvgpu.agent.mps, kvgpu.logs
        std = sysconfig.get_paths()["stdlib"]
        roots = set()
        for name, mod in list(sys.modules.items()):
            f = getattr(mod, "__file__", None)
            if "." not in name and f and not f.startswith(std):
                path = Path(f).resolve()
                roots.add(str(path.parents[1] if path.name == "__init__.py" else path.parent))
        print("\\n".join(sorted(roots)))
    """
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return [d for d in p.stdout.split() if d]


def _pod_python() -> str:
    exe = str(Path(sys.executable).resolve())
    return exe if any(exe.startswith(f"/usr/{d}/") for d in HOST_USR) else "/usr/bin/python3"


def mps_owner_pod(node: RealNode) -> dict[str, Any]:
    """The chart's kvgpu-mps pod (charts/kvgpu/templates/mps.yaml): its command (``kvgpu mps-daemons
    --root=/var/run/kvgpu/mps --interval=5``), env, securityContext and MPS root hostPath; no API
    access. Differences, for this node: a bare Pod bound to the node (no DaemonSet controller
    here), the host network (no pod network tools on the machine), the hostroot image with the
    machine's /usr and kvgpu's Python folders read-only (the product image is not built there),
    and, for the NVIDIA runtime the chart names (runtimeClassName, NVIDIA_VISIBLE_DEVICES=all),
    one unit of the runtime stand-in's resource: every card's device node and the driver folders."""
    dirs = _python_dirs()
    mounts = [{"name": f"usr-{d}", "mountPath": f"/usr/{d}", "readOnly": True} for d in HOST_USR]
    vols: list[dict[str, Any]] = [{"name": f"usr-{d}", "hostPath": {"path": f"/usr/{d}", "type": "Directory"}}
                                  for d in HOST_USR]
    for i, d in enumerate(dirs):
        mounts.append({"name": f"py-{i}", "mountPath": f"/py/{i}", "readOnly": True})
        vols.append({"name": f"py-{i}", "hostPath": {"path": d, "type": "Directory"}})
    mounts.append({"name": "mps", "mountPath": keys.HOST_MPS_ROOT})
    vols.append({"name": "mps", "hostPath": {"path": keys.HOST_MPS_ROOT, "type": "DirectoryOrCreate"}})
    env = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
           {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
           {"name": "PYTHONPATH", "value": ":".join(f"/py/{i}" for i in range(len(dirs)))},
           {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}, {"name": "PYTHONUNBUFFERED", "value": "1"}]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": MPS_OWNER, "namespace": MPS_OWNER_NS,
                     "labels": {"app.kubernetes.io/name": "kvgpu", "app.kubernetes.io/component": "mps"}},
        "spec": {
            "nodeName": node.name, "automountServiceAccountToken": False, "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 30, "hostNetwork": True,
            "containers": [{
                "name": "mps", "image": "kvgpu.local/hostroot:1", "imagePullPolicy": "Never",
                "command": [_pod_python(), "-m", "kvgpu.cli.main"],
                "args": ["mps-daemons", f"--root={keys.HOST_MPS_ROOT}", "--interval=5"],
                "env": env, "resources": {"limits": {RUNTIME_RESOURCE: 1}},
                "securityContext": MPS_OWNER_SECURITY, "volumeMounts": mounts,
            }],
            "volumes": vols,
        },
    }


def _json_tail(out: str) -> dict[str, Any]:
    try:
        return dict(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {}


def _phase(c: Cluster, name: str, ns: str = "default") -> str | None:
    p = c.kubectl("get", "pod", name, "-n", ns, "-o", "json", check=False)
    return json.loads(p.stdout)["status"].get("phase") if p.returncode == 0 else None


def _mps_processes() -> list[dict[str, Any]]:
    """The MPS control daemons and servers on the host: pid, argv, cgroup, CapEff."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not (proc / "comm").read_text().startswith("nvidia-cuda-mps"):
                continue
            caps = next((ln.split()[1] for ln in (proc / "status").read_text().splitlines()
                         if ln.startswith("CapEff:")), "")
            out.append({"pid": int(proc.name), "argv": (proc / "cmdline").read_text().replace("\0", " ").strip(),
                        "cgroup": (proc / "cgroup").read_text().strip(), "capEff": caps})
        except OSError:
            continue
    return out


def _mps_logs(uuid: str | None) -> None:
    if uuid is None:
        return
    for name in ("control.log", "server.log"):
        f = mpsd.log_dir(MPS_ROOT, uuid) / name
        try:
            text = "\n".join(f.read_text(errors="replace").splitlines()[-25:])
        except OSError as e:
            text = str(e)
        print(f"--- {f} (last lines)\n{text}", flush=True)


def mps(c: Cluster, node: RealNode, runtime: RuntimePlugin, res: dict[str, Any]) -> None:
    """The MPS backend on the real node: the owner of the daemons as a pod, two sliced clients.
    Results go into ``res`` as they come (a failed step leaves the earlier ones)."""
    uuid: str | None = None
    say("native matmul on the host (before any MPS daemon runs)")
    native = matmul([TORCH_PY, str(REPO_ROOT / "bench/gpu/matmul.py"), "10", "native"])
    res["mps_matmul_native_its"] = native["its"]
    try:
        say("the agent with --mps-daemons=separate, the NVIDIA runtime's stand-in, the kvgpu-mps pod")
        node.restart_agent(["--mps-daemons=separate"])
        runtime.start()
        wait(lambda: (node.node() or {}).get("status", {}).get("allocatable", {}).get(RUNTIME_RESOURCE),
             60, f"{RUNTIME_RESOURCE} on the node")
        owner = mps_owner_pod(node)
        print(json.dumps(owner), flush=True)
        c.kubectl("apply", "-f", "-", input=json.dumps(owner))
        wait(lambda: _phase(c, MPS_OWNER, MPS_OWNER_NS) in ("Running", "Failed"), 120, "the kvgpu-mps pod Running")
        show(c, "get", "pod", MPS_OWNER, "-n", MPS_OWNER_NS, "-o", "wide")
        res["mps_owner_phase"] = _phase(c, MPS_OWNER, MPS_OWNER_NS)
        st = show(c, "exec", MPS_OWNER, "-n", MPS_OWNER_NS, "--", "/usr/bin/sh", "-c",
                  "grep -E '^(Uid|CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/1/status; "
                  "grep ' / ' /proc/mounts; ls -l /dev/nvidia* /usr/local/nvidia/bin")
        res["mps_owner_capeff"] = next((ln.split()[1] for ln in st.splitlines() if ln.startswith("CapEff:")), None)
        res["mps_owner_root_ro"] = any(len(f := ln.split()) > 3 and f[1] == "/" and "ro" in f[3].split(",")
                                       for ln in st.splitlines())

        say("the node's card in an mps pool: the agent writes wanted.json, the pod starts its daemon")
        node.apply_pool(mode="mps")
        wanted = wait(lambda: mpsd.parse_wanted((MPS_ROOT / mpsd.WANTED_FILE).read_text())
                      if (MPS_ROOT / mpsd.WANTED_FILE).exists() else None, 60, "the card in wanted.json")
        uuid = wanted[0]
        res["mps_card"] = uuid
        wait(lambda: mpsd.check_ready(MPS_ROOT, uuid) is None, 60,
             "the owner's fresh status with the card's daemon answering")
        show(c, "logs", MPS_OWNER, "-n", MPS_OWNER_NS, "--tail=20")
        procs = _mps_processes()
        print(json.dumps(procs, indent=1), flush=True)
        pod_uid = json.loads(c.kubectl("get", "pod", MPS_OWNER, "-n", MPS_OWNER_NS, "-o", "json").stdout)[
            "metadata"]["uid"]
        daemons = [p for p in procs if "mps-control" in p["argv"]]
        res["mps_daemon_in_owner_pod"] = bool(daemons) and all(
            pod_uid in p["cgroup"] or pod_uid.replace("-", "_") in p["cgroup"] for p in daemons)
        res["mps_daemon_capeff"] = sorted({p["capEff"] for p in daemons})

        say("two sliced pods on the card: 3000 MiB / 30 %, and 4000 MiB / 50 % that sets the MPS env itself")
        for name, mib, cores in MPS_TENANTS:
            pod = seed_pod(name, mib, cores)
            if name == "mps-b":
                ctr = pod["spec"]["containers"][0]  # type: ignore[index]
                ctr["env"] += [{"name": k, "value": v} for k, v in MPS_FORGED_ENV.items()]
            c.kubectl("apply", "-f", "-", input=json.dumps(pod))
        for name, _, _ in MPS_TENANTS:
            wait(lambda n=name: _phase(c, n) in ("Running", "Failed"), 120, f"{name} Running")
        show(c, "get", "pods", "-A", "-o", "wide")
        show(c, "get", "vgpuclaims", "-o", "wide")
        for name, mib, cores in MPS_TENANTS:
            say(f"inside {name} ({mib} MiB, {cores} %)")
            show(c, "exec", name, "--", "/usr/bin/sh", "-c", "ls -la /var/run/kvgpu-mps; cat /etc/kvgpu/claim; echo; "
                 "grep -E 'kvgpu|nvidia' /proc/self/mounts; env | grep -E 'KVGPU|NVIDIA|CUDA_MPS|LD_' | sort")
            smi = show(c, "exec", name, "--", "nvidia-smi")
            res[f"{name}_nvidia_smi"] = re.search(rf"\b\d+MiB\s*/\s*{mib}MiB", smi) is not None
            env = _json_tail(show(c, "exec", name, "--", TORCH_PY, "/repo/bench/gpu/mps_env.py", timeout=120))
            res[f"{name}_env_at_start"] = env.get("env_at_start")
            res[f"{name}_env_after_init"] = got = env.get("env_after_init")
            res[f"{name}_env_error"] = env.get("error")
            res[f"{name}_env_ok"] = got == {"CUDA_MPS_PIPE_DIRECTORY": keys.CONTAINER_MPS_DIR,
                                            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(cores),
                                            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={mib}M"}
            m = memtest(c, name)
            res[f"{name}_torch_exception"], res[f"{name}_torch_reachable_mib"] = m.get("error"), m.get("reachable_mib")
            res[f"{name}_mem_get_info_mib"] = m.get("mem_get_info_before_mib")

        say("matmul in both pods at once (MPS runs co-tenants concurrently); nvidia-smi on the host meanwhile")
        kubectl = [str(c.bin_dir / "kubectl"), f"--kubeconfig={c.kubeconfig}"]
        runs = {name: subprocess.Popen([*kubectl, "exec", name, "--", TORCH_PY, "/repo/bench/gpu/matmul.py", "15",
                                        name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for name, _, _ in MPS_TENANTS}
        time.sleep(10)
        host = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60, check=False).stdout
        print(f"$ nvidia-smi (host)\n{host.rstrip()}", flush=True)
        res["mps_host_smi_server"] = "nvidia-cuda-mps-server" in host
        res["mps_host_smi_clients_mc"] = len(re.findall(r"\sM\+C\s", host))
        for name in runs:
            out, _ = runs[name].communicate(timeout=120)
            print(out.rstrip()[-1500:], flush=True)
            its = _json_tail(out).get("its")
            res[f"{name}_matmul_its"] = its
            res[f"{name}_matmul_percent_of_native"] = round(100 * its / native["its"], 1) if its else None
        status = mpsd.read_status(MPS_ROOT)
        res["mps_status"] = (MPS_ROOT / mpsd.STATUS_FILE).read_text().strip() if status else None
        res["mps_status_age_s"] = round(time.time() - status.time, 1) if status else None
        res["mps_status_fresh"] = mpsd.not_ready(status, uuid, time.time()) is None
        show(c, "exec", MPS_OWNER, "-n", MPS_OWNER_NS, "--", "/usr/bin/sh", "-c",
             f"echo get_server_list | CUDA_MPS_PIPE_DIRECTORY={mpsd.pipe_dir(MPS_ROOT, uuid)} "
             "/usr/local/nvidia/bin/nvidia-cuda-mps-control")
        show(c, "get", "events", "-A", "--sort-by=.lastTimestamp")
    finally:
        _mps_logs(uuid)
        show(c, "logs", MPS_OWNER, "-n", MPS_OWNER_NS, "--tail=30")
        c.kubectl("delete", "pod", *(n for n, _, _ in MPS_TENANTS), "--wait=true", "--timeout=60s", check=False)
        c.kubectl("delete", "pod", MPS_OWNER, "-n", MPS_OWNER_NS, "--wait=true", "--timeout=60s", check=False)
        left = _mps_processes()
        res["mps_processes_left_after_owner"] = len(left)
        runtime.stop()


def mps_ok(res: dict[str, Any]) -> bool:
    oom = "OutOfMemoryError"
    ok = res.get("mps_owner_phase") == "Running" and res.get("mps_owner_capeff") == SETUID_SETGID_CAPS
    ok = ok and bool(res.get("mps_owner_root_ro") and res.get("mps_daemon_in_owner_pod"))
    ok = ok and bool(res.get("mps_status_fresh") and res.get("mps_host_smi_server"))
    ok = ok and (res.get("mps_host_smi_clients_mc") or 0) >= 2
    for name, mib, cores in MPS_TENANTS:
        ok = ok and bool(res.get(f"{name}_nvidia_smi") and res.get(f"{name}_env_ok"))
        ok = ok and str(res.get(f"{name}_torch_exception")).endswith(oom)
        ok = ok and (res.get(f"{name}_torch_reachable_mib") or 1e9) < mib
        ok = ok and abs((res.get(f"{name}_matmul_percent_of_native") or 0) - cores) <= 10
    return bool(ok)


