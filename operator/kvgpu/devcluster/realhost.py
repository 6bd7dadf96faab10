"""The host side of the real node (:mod:`kvgpu.devcluster.realnode`): where it puts things
(the constants), its errors, the machine-wide lock, containerd's build and the CNI plugins, and
the helpers that find and undo what a real node leaves on the host: mounts, processes, links and
addresses, cgroups, iptables chains (:func:`clean_host`, :func:`leftovers`)."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from kvgpu.devcluster.cluster import REPO_ROOT

CONTAINERD_BUILD = REPO_ROOT / "hack" / "realnode" / "build.sh"
SHIM_SOURCE = REPO_ROOT / "shim" / "_build" / "libvgpu.so"
LOCK_FILE = Path("/run/lock/kvgpu-realnode.lock")
HOST_STATE = Path("/run/kvgpu-realnode.json")  # what a running (or killed) real node put on the host
KUBELET_ROOT = Path("/var/lib/kubelet")
CNI_BIN_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))
CNI_NETWORK = "kvgpu"
NODE_BRIDGE = "kvgpu-nip0"  # holds the node IP (/32): the kubelet refuses a loopback node IP
POD_BRIDGE = "kvgpu-cni0"  # the CNI bridge of the pod network
FIXED_DIRS = (  # host paths a real kubelet/containerd/agent use whatever their config says
    Path("/var/lib/kubelet"), Path("/var/log/pods"), Path("/var/log/containers"),
    Path(f"/var/lib/cni/networks/{CNI_NETWORK}"), Path("/run/containerd/runc/k8s.io"),
    Path("/var/lib/kvgpu"), Path("/usr/local/kvgpu"), Path("/run/kvgpu-realnode"),
    Path("/run/kvgpu"),  # the MPS daemons' root, /var/run/kvgpu/mps (the agent's wanted.json, status.json)
)
MPS_ROOTS = (Path("/run/kvgpu/mps"), Path("/var/run/kvgpu/mps"))  # the agent's HOST_MPS_ROOT, either spelling
SOCKET_DIR = Path("/run/kvgpu-realnode")  # containerd's sockets: a unix socket path has at most 107 bytes,
#                                           and a run directory under pytest's tmp dir is longer
KUBE_CHAINS = (("mangle", "KUBE-IPTABLES-HINT"), ("filter", "KUBE-FIREWALL"), ("mangle", "KUBE-KUBELET-CANARY"),
               ("nat", "KUBE-KUBELET-CANARY"), ("filter", "KUBE-KUBELET-CANARY"))
# Device numbers as on the H200 machines (shared/research/gpu-node-facts.md).
NVIDIA_MAJOR, NVIDIACTL_MINOR, UVM_MAJOR = 195, 255, 238
READY_TIMEOUT_S = 90.0


class RealNodeUnavailable(RuntimeError):
    """This machine cannot run the real node (not root, a binary or package missing, the lock
    held by another run). Tests skip on it unless KVGPU_REQUIRE_REAL_NODE=1."""


class RealNodeError(RuntimeError):
    """The real node failed to start or to stop cleanly (the message says what is left)."""


def take_host_lock(holder: str) -> IO[str]:
    """The machine-wide lock of the real node (:data:`LOCK_FILE`), held until
    :func:`release_host_lock`; ``holder`` is written into it for whoever finds it taken.
    Raises :class:`RealNodeUnavailable` naming the holder if another real node runs here."""
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    f = LOCK_FILE.open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        held_by = f.read().strip() or "?"
        f.close()
        raise RealNodeUnavailable(f"another real node runs on this machine ({LOCK_FILE} held by "
                                  f"{held_by})") from None
    f.seek(0)
    f.truncate()
    f.write(holder + "\n")
    f.flush()
    return f


def release_host_lock(f: IO[str]) -> None:
    f.seek(0)
    f.truncate()
    fcntl.flock(f, fcntl.LOCK_UN)
    f.close()


def cni_bin_dir() -> Path | None:
    """The first of :data:`CNI_BIN_DIRS` with the bridge, host-local and loopback plugins."""
    for d in CNI_BIN_DIRS:
        if all((d / p).exists() for p in ("bridge", "host-local", "loopback")):
            return d
    return None


def ensure_containerd() -> Path:
    """The directory with containerd, containerd-shim-runc-v2 and ctr (hack/realnode/build.sh,
    cached; ``KVGPU_CONTAINERD_BIN`` overrides)."""
    env = os.environ.get("KVGPU_CONTAINERD_BIN")
    if env:
        return Path(env)
    proc = subprocess.run([str(CONTAINERD_BUILD)], stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise RealNodeUnavailable(f"building containerd failed (exit {proc.returncode}); see the output above")
    return Path(proc.stdout.strip().splitlines()[-1])


# ----- host helpers -----------------------------------------------------------------------------
def _mounts() -> list[str]:
    """Mount points, in mount order (from /proc/self/mountinfo)."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        out.append(mp)
    return out


def _under(path: str, roots: Sequence[Path]) -> bool:
    return any(path == str(r) or path.startswith(str(r).rstrip("/") + "/") for r in roots)


def _umount_under(roots: Sequence[Path]) -> None:
    for _ in range(5):  # stacked mounts (the kubelet's self-bind of /var/lib/kubelet) take several rounds
        hits = [m for m in _mounts() if _under(m, roots)]
        if not hits:
            return
        for m in sorted(set(hits), key=lambda p: (-p.count("/"), p)):
            if subprocess.run(["umount", m], capture_output=True, check=False).returncode != 0:
                subprocess.run(["umount", "-l", m], capture_output=True, check=False)


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def _runs(pid: int, exe: Path | str) -> bool:
    e = _exe(pid)
    return bool(e) and Path(e.removesuffix(" (deleted)")).resolve() == Path(exe).resolve()


def _stop_pid(pid: int, exe: Path | str, timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL, a process we started — only if it still runs ``exe``."""
    if not pid or not _runs(pid, exe):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _runs(pid, exe):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        if not _runs(pid, exe):
            return
        time.sleep(0.05)


def _pids_of(exe: Path) -> list[int]:
    """PIDs whose executable is exactly ``exe`` (our containerd's shims: containerd starts them
    detached, so they are not our children)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and _runs(int(d.name), exe):
            out.append(int(d.name))
    return out


def _link_exists(name: str) -> bool:
    return Path(f"/sys/class/net/{name}").exists()


def _ip(*args: str, check: bool = True) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and p.returncode != 0:
        raise RealNodeError(f"ip {' '.join(args)} failed: {p.stderr.strip()}")


def _addr_of(ifname: str) -> str | None:
    """The IPv4 address of interface ``ifname`` (SIOCGIFADDR), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(res[20:24])


def host_addresses() -> list[str]:
    """IPv4 addresses of the host's interfaces (no ``ip`` tool needed), loopback excluded."""
    out = []
    for d in sorted(Path("/sys/class/net").iterdir()):
        a = _addr_of(d.name)
        if a and not ipaddress.ip_address(a).is_loopback:
            out.append(a)
    return out


def host_node_ip() -> str:
    """A node IP for a real node that uses the host's own network (``gpu=True``): the first
    non-loopback IPv4 address. Raises :class:`RealNodeUnavailable` if there is none."""
    addrs = host_addresses()
    if not addrs:
        raise RealNodeUnavailable("no non-loopback IPv4 address on this host for the kubelet's node IP")
    return addrs[0]


def _cgroup_dirs() -> list[Path]:
    """The kubelet's kubepods cgroups in every mounted hierarchy."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        parts = line.split()
        fstype = parts[parts.index("-") + 1]
        if fstype in ("cgroup", "cgroup2"):
            for name in ("kubepods", "kubepods.slice"):
                p = Path(parts[4]) / name
                if p.is_dir():
                    out.append(p)
    return out


def _rm_cgroups() -> None:
    for top in _cgroup_dirs():
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -t[0].count("/")):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass


def _flush_chains() -> None:
    """The kubelet's iptables chains (only if an iptables binary exists; the kubelet is told not
    to create them, makeIPTablesUtilChains: false, so this is for older runs)."""
    for tool in ("iptables", "ip6tables"):
        if not shutil.which(tool):
            continue
        for table, chain in KUBE_CHAINS:
            if subprocess.run([tool, "-w", "-t", table, "-nL", chain], capture_output=True,
                              check=False).returncode != 0:
                continue
            for parent in ("INPUT", "OUTPUT", "FORWARD", "PREROUTING", "POSTROUTING"):
                while subprocess.run([tool, "-w", "-t", table, "-D", parent, "-j", chain], capture_output=True,
                                     check=False).returncode == 0:
                    pass
            subprocess.run([tool, "-w", "-t", table, "-F", chain], capture_output=True, check=False)
            subprocess.run([tool, "-w", "-t", table, "-X", chain], capture_output=True, check=False)


def mps_daemons(roots: Sequence[Path] = MPS_ROOTS) -> list[int]:
    """PIDs of MPS control daemons whose pipe folder is under ``roots`` (the node's MPS root:
    the agent starts them detached, in their own session, so they outlive it by design)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or b"nvidia-cuda-mps-control" not in (d / "cmdline").read_bytes():
                continue
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        pipes = [v.split(b"=", 1)[1].decode(errors="replace") for v in env if v.startswith(b"CUDA_MPS_PIPE_DIRECTORY=")]
        if any(_under(p, roots) for p in pipes):
            out.append(int(d.name))
    return out


def stop_mps_daemons(roots: Sequence[Path] = MPS_ROOTS) -> None:
    """End the real node's MPS control daemons (before their root is removed: without their pipe
    nothing could reach them any more)."""
    for pid in mps_daemons(roots):
        _stop_pid(pid, _exe(pid), timeout=5)


def clean_host(state: dict[str, Any] | None = None) -> None:
    """Remove what a real node leaves on the host (section 7 of the recipe). ``state`` is the
    record of the run (HOST_STATE): its processes are stopped by PID (after checking their
    executable), its containers killed through runc, its containerd root unmounted."""
    state = state or {}
    runc_root = Path(state.get("runcRoot") or "/run/containerd/runc/k8s.io")
    if shutil.which("runc") and runc_root.is_dir():  # containers of a containerd that is gone
        ids = subprocess.run(["runc", "--root", str(runc_root), "list", "-q"], capture_output=True, text=True,
                             check=False).stdout.split()
        for cid in ids:
            subprocess.run(["runc", "--root", str(runc_root), "kill", cid, "KILL"], capture_output=True, check=False)
    for name in ("kubelet", "containerd"):
        p = state.get("pids", {}).get(name)
        if p:
            _stop_pid(int(p["pid"]), p["exe"], timeout=10)
    shim = state.get("shim")
    if shim:
        for pid in _pids_of(Path(shim)):
            _stop_pid(pid, shim, timeout=5)
    if shutil.which("runc") and runc_root.is_dir():
        for cid in subprocess.run(["runc", "--root", str(runc_root), "list", "-q"], capture_output=True,
                                  text=True, check=False).stdout.split():
            subprocess.run(["runc", "--root", str(runc_root), "delete", "-f", cid], capture_output=True, check=False)
    roots = [*FIXED_DIRS, Path("/run/netns"), Path("/var/run/netns")]
    roots += [Path(p) for p in state.get("mountRoots", [])]
    _umount_under(roots)
    for netns_dir in (Path("/run/netns"),):
        for ns in netns_dir.glob("cni-*"):
            ns.unlink(missing_ok=True)
    stop_mps_daemons()
    for d in FIXED_DIRS:
        shutil.rmtree(d, ignore_errors=True)
    for pattern in (f"{CNI_NETWORK}-*", "cni-loopback-*"):  # libcni's result cache (pod network, loopback)
        for f in Path("/var/lib/cni/results").glob(pattern):
            f.unlink(missing_ok=True)
    for d in (Path("/run/containerd/runc"), Path("/run/containerd/s"), Path("/run/containerd"),
              Path("/var/lib/cni/results"), Path("/var/lib/cni/networks"), Path("/var/lib/cni"), Path("/run/netns")):
        try:
            d.rmdir()
        except OSError:
            pass
    for br in (POD_BRIDGE, NODE_BRIDGE):
        if _link_exists(br):
            _ip("link", "del", br, check=False)
    _rm_cgroups()
    _flush_chains()
    HOST_STATE.unlink(missing_ok=True)


def leftovers(state: dict[str, Any] | None = None) -> list[str]:
    """What of a real node is still on the host (empty after a clean :func:`clean_host`)."""
    state = state or {}
    left = []
    roots = [*FIXED_DIRS, Path("/run/netns")] + [Path(p) for p in state.get("mountRoots", [])]
    left += [f"mount {m}" for m in _mounts() if _under(m, roots)]
    for name, p in state.get("pids", {}).items():
        if _runs(int(p["pid"]), p["exe"]):
            left.append(f"process {name} pid {p['pid']}")
    if state.get("shim"):
        left += [f"process containerd-shim pid {pid}" for pid in _pids_of(Path(state["shim"]))]
    left += [f"process nvidia-cuda-mps-control pid {pid}" for pid in mps_daemons()]
    left += [f"path {d}" for d in FIXED_DIRS if d.exists()]
    left += [f"netns {ns}" for ns in Path("/run/netns").glob("cni-*")]
    left += [f"cni result {f}" for f in Path("/var/lib/cni/results").glob(f"{CNI_NETWORK}-*")]
    left += [f"bridge {br}" for br in (POD_BRIDGE, NODE_BRIDGE) if _link_exists(br)]
    left += [f"cgroup {c}" for c in _cgroup_dirs()]
    return left
