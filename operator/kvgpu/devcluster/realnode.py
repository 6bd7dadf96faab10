"""One real node for the dev cluster: containerd 2.2 + runc + CNI bridge + a real kubelet (from
the ktp binary) registered with a :class:`~kvgpu.devcluster.cluster.Cluster`, and kvgpu's node
agent (device plugin on the real ``kubelet.sock``) against simulated cards — or, with
``gpu=True`` on a machine with an NVIDIA driver, the host's cards (NVML, ``/dev/nvidia*``, the
driver folder ``/usr/local/nvidia``), and a node IP already on one of the host's interfaces.

What it touches on the host (one real node per machine, guarded by a machine-wide lock):
``/var/lib/kubelet`` (the kubelet's root; the device-plugin socket path is a constant there),
``/run/containerd`` (shim sockets), ``/var/run/netns/cni-*``, ``/var/lib/cni``,
``/var/log/pods``, ``/var/log/containers``, the agent's ``/usr/local/kvgpu`` and
``/var/lib/kvgpu``, two bridges (node IP, pod network) and the kubelet's ``kubepods`` cgroups.
Everything else lives in ``<cluster run dir>/realnode/``. :meth:`RealNode.stop` removes all of
it and raises :class:`RealNodeError` if something is left; :meth:`RealNode.start` first cleans
up what a killed earlier run left (recorded in ``/run/kvgpu-realnode.json``).

Needs root, hack/realnode/build.sh (containerd), runc, the CNI plugins, busybox-static and gcc
(``make realnode``); otherwise :meth:`start` raises :class:`RealNodeUnavailable` with the reason.
See docs/development.md, "The real node".
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvgpu.devcluster import images
from kvgpu.devcluster.cluster import REPO_ROOT, Cluster, ClusterError, die_with_parent

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
)
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
    left += [f"path {d}" for d in FIXED_DIRS if d.exists()]
    left += [f"netns {ns}" for ns in Path("/run/netns").glob("cni-*")]
    left += [f"cni result {f}" for f in Path("/var/lib/cni/results").glob(f"{CNI_NETWORK}-*")]
    left += [f"bridge {br}" for br in (POD_BRIDGE, NODE_BRIDGE) if _link_exists(br)]
    left += [f"cgroup {c}" for c in _cgroup_dirs()]
    return left


# ----- the node ----------------------------------------------------------------------------------
@dataclass
class RealNode:
    """A real kubelet + containerd node named ``name`` in ``cluster``; :meth:`start`/:meth:`stop`."""

    cluster: Cluster
    name: str = "kvgpu-real-0"
    node_ip: str = "10.250.0.1"
    pod_cidr: str = "10.244.0.0/24"
    cards: int = 2  # simulated H200 cards (sim.json, /dev nodes); ignored with gpu
    gpu: bool = False  # the host's real cards, NVML and driver instead of simulated ones
    runc_debug: bool = False  # wrap runc: keep each bundle's config.json and runc's debug log on failure
    containerd_bin: Path | None = None
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)
    _argv: dict[str, list[str]] = field(default_factory=dict, repr=False)
    _lock: IO[str] | None = field(default=None, repr=False)
    agent: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    agent_starts: int = 0
    _agent_args: tuple[str, ...] = ()

    # ----- paths ---------------------------------------------------------------------------
    @property
    def dir(self) -> Path:
        return self.cluster.run_dir / "realnode"

    @property
    def socket(self) -> Path:
        return SOCKET_DIR / "containerd.sock"

    @property
    def kubelet_log(self) -> Path:
        return self.dir / "kubelet.log"

    @property
    def containerd_log(self) -> Path:
        return self.dir / "containerd.log"

    @property
    def agent_log(self) -> Path:
        return self.dir / f"agent-{self.agent_starts}.log"

    @property
    def driver_root(self) -> Path:
        """The node's driver directory: the host's ``/usr/local/nvidia`` with ``gpu``, else the
        simulated node's (the stub: lib64/libcuda.so.1, lib64/libnvidia-ml.so.1)."""
        return Path(images.DRIVER_MOUNT) if self.gpu else self.dir / "driver"

    @property
    def dev_root(self) -> Path:
        """The NVIDIA device nodes: the host's ``/dev`` with ``gpu``, else fake ones (nvidia0..,
        nvidiactl, nvidia-uvm, nvidia-uvm-tools)."""
        return Path("/dev") if self.gpu else self.dir / "dev"

    @property
    def sim_file(self) -> Path:
        return self.dir / "sim.json"

    @property
    def state_file(self) -> Path:
        return self.dir / "realnode.json"

    @property
    def runc_root(self) -> Path:
        return self.dir / "runc"

    def kubelet_checkpoint(self) -> str:
        """The kubelet's device-manager checkpoint (JSON: ``Data.PodDeviceEntries`` with each
        container's device IDs): what PodResources, and so DCGM, report per container."""
        return (KUBELET_ROOT / "device-plugins" / "kubelet_internal_checkpoint").read_text()

    def image(self, name: str) -> str:
        """The image reference of a built-in image: ``tenant`` -> ``kvgpu.local/tenant:1``."""
        return name if "/" in name else f"kvgpu.local/{name}" + ("" if ":" in name else ":1")

    def import_product_images(self) -> tuple[str, ...]:
        """Build (cached; only on this call, never in :meth:`start`) and import the operator and
        agent images (:mod:`kvgpu.devcluster.productimages`); returns their references
        (``kvgpu.local/kvgpu-operator:<version>``, ``kvgpu.local/kvgpu-agent:<version>``)."""
        from kvgpu.devcluster import productimages

        assert self.containerd_bin is not None, "start() the node first"
        img = productimages.build_product_images()
        images.import_image([str(self.containerd_bin / "ctr"), f"--address={self.socket}"], img.archive)
        return img.refs

    def ctr(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``ctr --address=<socket> -n k8s.io ARGS``."""
        assert self.containerd_bin is not None
        cmd = [str(self.containerd_bin / "ctr"), f"--address={self.socket}", "-n", "k8s.io", *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if check and p.returncode != 0:
            raise RealNodeError(f"ctr {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
        return p

    # ----- checks --------------------------------------------------------------------------
    def _check(self) -> None:
        if os.geteuid() != 0:
            raise RealNodeUnavailable("the real node needs root (mounts, cgroups, network namespaces)")
        if not (self.cluster.bin_dir / "kubelet").exists():
            raise RealNodeUnavailable(f"{self.cluster.bin_dir} has no kubelet: rebuild hack/ktp (make ktp)")
        tools = [("runc", "apt-get install runc"), ("gcc", "gcc"), ("ldconfig", "libc-bin")]
        if not self._ip_on_host():
            tools.append(("ip", "iproute2"))  # the bridge that holds the node IP
        for tool, why in tools:
            if not shutil.which(tool):
                raise RealNodeUnavailable(f"no {tool} on PATH ({why}; `make realnode` installs runc and "
                                          "the CNI plugins)")
        cni = self._cni_bin()
        if cni is None:
            raise RealNodeUnavailable("no CNI plugins (bridge, host-local, loopback) in /usr/lib/cni or /opt/cni/bin: "
                                      "apt-get install containernetworking-plugins (or `make realnode`)")
        if self.gpu and not Path(images.DRIVER_MOUNT, "lib64").is_dir():
            raise RealNodeUnavailable(f"gpu=True but no NVIDIA driver folder {images.DRIVER_MOUNT}/lib64 here")
        if not self.gpu and not Path("/bin/busybox").exists():
            raise RealNodeUnavailable("no /bin/busybox: apt-get install busybox-static (or `make realnode`)")
        if not SHIM_SOURCE.exists():
            raise RealNodeUnavailable(f"{SHIM_SOURCE} not built: make shim")
        if self.containerd_bin is None:
            self.containerd_bin = ensure_containerd()
        for b in ("containerd", "containerd-shim-runc-v2", "ctr"):
            if not (self.containerd_bin / b).exists():
                raise RealNodeUnavailable(f"{self.containerd_bin / b} missing: hack/realnode/build.sh")

    @staticmethod
    def _cni_bin() -> Path | None:
        for d in CNI_BIN_DIRS:
            if all((d / p).exists() for p in ("bridge", "host-local", "loopback")):
                return d
        return None

    def _take_lock(self) -> None:
        LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
        f = LOCK_FILE.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise RealNodeUnavailable(f"another real node runs on this machine ({LOCK_FILE} held by "
                                      f"{holder})") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} run dir {self.cluster.run_dir}\n")
        f.flush()
        self._lock = f

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.seek(0)
            self._lock.truncate()
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    # ----- lifecycle -----------------------------------------------------------------------
    def start(self) -> RealNode:
        self._check()
        self._take_lock()
        try:
            if HOST_STATE.exists():
                try:
                    old = json.loads(HOST_STATE.read_text())
                except (OSError, ValueError):
                    old = {}
                print(f"realnode: cleaning up after an earlier run ({old.get('runDir', '?')})", file=sys.stderr)
                clean_host(old)
            left = leftovers()
            if left:
                clean_host()
            self._prepare()
            self._save_host_state()
            self._network()
            self._start_containerd()
            assert self.containerd_bin is not None
            for img in ([images.build_pause(), images.build_hostroot()] if self.gpu else images.build_all()):
                images.import_image([str(self.containerd_bin / "ctr"), f"--address={self.socket}"], img.archive)
            self._start_kubelet()
            self.wait_ready()
        except BaseException:
            self.stop(check=False)
            raise
        return self

    def _prepare(self) -> None:
        if self.dir.exists():
            _umount_under([self.dir])
            shutil.rmtree(self.dir)
        for d in ("containerd", "cni/net.d", "kubelet", "runc-debug", "opt"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        SOCKET_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not self.gpu:
            self._simulated_devices()
        self._write_containerd_config()
        self._write_cni()
        self._write_kubelet_config()

    def _simulated_devices(self) -> None:
        """The simulated node's driver folder, fake device nodes and NVML stand-in (sim.json)."""
        images.build_driver_root(self.driver_root)
        self.dev_root.mkdir()
        nodes = [(f"nvidia{i}", NVIDIA_MAJOR, i) for i in range(self.cards)]
        nodes += [("nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR), ("nvidia-uvm", UVM_MAJOR, 0),
                  ("nvidia-uvm-tools", UVM_MAJOR, 1)]
        for n, major, minor in nodes:
            os.mknod(self.dev_root / n, 0o666 | 0o020000, os.makedev(major, minor))
            os.chmod(self.dev_root / n, 0o666)
        self.sim_file.write_text(json.dumps({"nodes": [{"name": self.name, "cards": [
            {"model": "NVIDIA H200", "memoryMiB": 143771, "smCount": 132, "numa": 0, "count": self.cards}]}]},
            indent=2))

    def _write_containerd_config(self) -> None:
        assert self.containerd_bin is not None
        c = self.dir / "containerd"
        runtime_opts = ["SystemdCgroup = false", f"Root = '{self.runc_root}'"]
        if self.runc_debug:
            wrapper = self.dir / "runc-debug.sh"
            wrapper.write_text(RUNC_DEBUG_WRAPPER.replace("@DIR@", str(self.dir / "runc-debug"))
                               .replace("@RUNC@", shutil.which("runc") or "runc"))
            wrapper.chmod(0o755)
            runtime_opts.append(f"BinaryName = '{wrapper}'")
        opts = "\n        ".join(runtime_opts)
        (c / "config.toml").write_text(f"""version = 3
root = '{c / "root"}'
state = '{c / "state"}'
disabled_plugins = ['io.containerd.nri.v1.nri']
[grpc]
  address = '{self.socket}'
[plugins.'io.containerd.internal.v1.opt']
  path = '{self.dir / "opt"}'
[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{images.PAUSE}'
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true  # root here lacks CAP_SYS_RESOURCE: the kubelet's -998 would fail
  enable_cdi = true
  cdi_spec_dirs = ['{self.dir / "cdi"}']
  netns_mounts_under_state_dir = false
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        {opts}
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['{self._cni_bin()}']
    conf_dir = '{self.dir / "cni" / "net.d"}'
""")

    def _write_cni(self) -> None:
        conf = {"cniVersion": "0.4.0", "name": CNI_NETWORK, "plugins": [
            {"type": "bridge", "bridge": POD_BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": self.pod_cidr}]],
                      "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "loopback"}]}
        (self.dir / "cni" / "net.d" / "10-kvgpu.conflist").write_text(json.dumps(conf, indent=2))

    def _write_kubelet_config(self) -> None:
        cfg = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,  # default true since 1.35; this VM has the v1 hierarchy
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}", "imageServiceEndpoint": f"unix://{self.socket}",
            "address": self.node_ip, "port": 10250, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "clusterDomain": "cluster.local", "resolvConf": "/etc/resolv.conf",
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "registerNode": True, "serializeImagePulls": False,
            "makeIPTablesUtilChains": False,  # no KUBE-* chains left on the host
            "podCIDR": self.pod_cidr,
            "syncFrequency": "10s", "nodeStatusUpdateFrequency": "5s",
        }
        (self.dir / "kubelet" / "config.yaml").write_text(json.dumps(cfg, indent=2))

    def _ip_on_host(self) -> bool:
        return self.node_ip in host_addresses() and not _link_exists(NODE_BRIDGE)

    def _network(self) -> None:
        if self._ip_on_host():
            return  # the host's own address (gpu machines have no `ip` tool): no bridge needed
        if not _link_exists(NODE_BRIDGE):
            _ip("link", "add", NODE_BRIDGE, "type", "bridge")
        _ip("addr", "replace", f"{self.node_ip}/32", "dev", NODE_BRIDGE)
        _ip("link", "set", NODE_BRIDGE, "up")

    def _spawn(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        with log.open("ab") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=self.dir, env=env, start_new_session=True, preexec_fn=die_with_parent)
        self._procs[name] = proc
        self._argv[name] = argv
        self._save_state()
        self._save_host_state()

    def _start_containerd(self) -> None:
        assert self.containerd_bin is not None
        env = dict(os.environ, PATH=f"{self.containerd_bin}{os.pathsep}{os.environ.get('PATH', '')}")
        self._spawn("containerd", [str(self.containerd_bin / "containerd"),
                                   f"--config={self.dir / 'containerd' / 'config.toml'}"], self.containerd_log, env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._procs["containerd"].poll() is not None:
                raise RealNodeError(f"containerd exited with {self._procs['containerd'].returncode}:\n"
                                    f"{_tail(self.containerd_log)}")
            if self.socket.exists() and self.ctr("version", check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise RealNodeError(f"containerd not answering on {self.socket} after 30 s:\n{_tail(self.containerd_log)}")

    def _start_kubelet(self) -> None:
        self._spawn("kubelet", [str(self.cluster.bin_dir / "kubelet"),
                                f"--config={self.dir / 'kubelet' / 'config.yaml'}",
                                f"--kubeconfig={self.cluster.kubeconfig}", f"--hostname-override={self.name}",
                                f"--node-ip={self.node_ip}", "--v=2"], self.kubelet_log)

    def node(self) -> dict[str, Any] | None:
        p = self.cluster.kubectl("get", "node", self.name, "-o", "json", check=False)
        return json.loads(p.stdout) if p.returncode == 0 else None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S, since: str = "") -> dict[str, Any]:
        """Wait until the node reports Ready (with a heartbeat newer than ``since``, an RFC 3339
        time, if given); returns the Node."""
        deadline = time.monotonic() + timeout
        last = "not registered"
        while time.monotonic() < deadline:
            kubelet = self._procs.get("kubelet")
            if kubelet is not None and kubelet.poll() is not None:
                raise RealNodeError(f"the kubelet exited with {kubelet.returncode}:\n{_tail(self.kubelet_log)}")
            n = self.node()
            if n is not None:
                conds = {c["type"]: c for c in n.get("status", {}).get("conditions", [])}
                ready = conds.get("Ready", {})
                last = f"Ready={ready.get('status')} ({ready.get('message', '')})"
                if ready.get("status") == "True" and ready.get("lastHeartbeatTime", "") > since:
                    return n
            time.sleep(0.5)
        raise RealNodeError(f"node {self.name} not Ready after {timeout:.0f} s: {last}\n{_tail(self.kubelet_log)}")

    def restart_kubelet(self, down_s: float = 0.0) -> dict[str, Any]:
        """Stop the kubelet (by PID) and start it again with the same command line; returns the
        Node once it is Ready again (a heartbeat after the restart)."""
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._stop_proc("kubelet")
        if down_s:
            time.sleep(down_s)
        self._spawn("kubelet", self._argv["kubelet"], self.kubelet_log)
        return self.wait_ready(since=since)

    def _stop_proc(self, name: str, timeout: float = 30.0) -> None:
        proc = self._procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._save_state()

    def pods_on_node(self) -> list[dict[str, Any]]:
        p = self.cluster.kubectl("get", "pods", "-A", "-o", "json", f"--field-selector=spec.nodeName={self.name}",
                                 check=False)
        return list(json.loads(p.stdout)["items"]) if p.returncode == 0 else []

    def _drain(self, timeout: float = 60.0) -> None:
        """Cordon the node (controllers' replacement pods stay Pending), delete every pod bound
        to it and wait until containerd runs no task."""
        self.cluster.kubectl("cordon", self.name, check=False)
        kubelet = self._procs.get("kubelet")
        kubelet_up = kubelet is not None and kubelet.poll() is None
        pods = self.pods_on_node()
        for p in pods:
            md = p["metadata"]
            args = ["delete", "pod", md["name"], "-n", md["namespace"], "--wait=false"]
            if not kubelet_up:
                args += ["--grace-period=0", "--force"]
            self.cluster.kubectl(*args, check=False)
        deadline = time.monotonic() + timeout
        while kubelet_up and time.monotonic() < deadline and self.pods_on_node():
            time.sleep(0.5)
        c = self._procs.get("containerd")
        if c is None or c.poll() is not None:
            return
        while time.monotonic() < deadline:
            if not self._tasks():
                return
            time.sleep(0.5)
        for t in self._tasks():  # the kubelet did not stop them in time: kill them
            self.ctr("tasks", "kill", "-a", "-s", "SIGKILL", t, check=False)
        end = time.monotonic() + 15
        while time.monotonic() < end and self._tasks():
            time.sleep(0.3)
        for t in self._tasks():
            self.ctr("tasks", "rm", "-f", t, check=False)

    def _tasks(self) -> list[str]:
        p = self.ctr("tasks", "ls", "-q", check=False)
        return p.stdout.split() if p.returncode == 0 else []

    def stop(self, check: bool = True) -> None:
        """Delete the node's pods, stop the agent, kubelet and containerd (by PID), remove every
        host path, mount, bridge and cgroup the node made, delete the Node object. With
        ``check``, raise :class:`RealNodeError` if anything is left."""
        try:
            if self._procs or self.agent is not None:
                try:
                    self._drain()
                except (ClusterError, RealNodeError, subprocess.TimeoutExpired, OSError) as e:
                    print(f"realnode: draining failed: {e}", file=sys.stderr)
            self.stop_agent()
            self._stop_proc("kubelet")
            self._stop_proc("containerd")
            state = self._host_state()
            clean_host(state)
            _umount_under([self.dir])
            self.cluster.kubectl("delete", "node", self.name, "--ignore-not-found", "--wait=false", check=False)
            self.cluster.kubectl("delete", "vgpupool", self.pool_name, "--ignore-not-found", "--wait=false",
                                 check=False)
            left = leftovers(state)
            if left and check:
                raise RealNodeError("the real node left on the host: " + "; ".join(left))
        finally:
            self._release_lock()

    def __enter__(self) -> RealNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----- the node agent ------------------------------------------------------------------
    def start_agent(self, extra_args: Sequence[str] = (), timeout: float = 60) -> subprocess.Popen[bytes]:
        """``kvgpu agent`` for this node (simulated cards, or NVML with ``gpu``; device plugin on
        the real kubelet); returns once the kubelet's node shows ``nvidia.com/gpu`` capacity."""
        if self.agent is not None and self.agent.poll() is None:
            raise RealNodeError("the agent already runs")
        self._agent_args = tuple(extra_args)
        argv = [sys.executable, "-m", "kvgpu.cli.main", "agent", "--node", self.name,
                "--kubeconfig", str(self.cluster.kubeconfig), "--interval", "5", "--shim-source", str(SHIM_SOURCE),
                "--metrics-port", "0", "--driver-root", str(self.driver_root), "--dev-root", str(self.dev_root)]
        if not self.gpu:
            argv += ["--simulated", str(self.sim_file)]
        argv += list(extra_args)
        self.agent_starts += 1
        with self.agent_log.open("ab") as f:
            self.agent = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          cwd=REPO_ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                          start_new_session=True, preexec_fn=die_with_parent)
        self._save_state()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.agent.poll() is not None:
                raise RealNodeError(f"the agent exited with {self.agent.returncode}:\n{_tail(self.agent_log)}")
            n = self.node() or {}
            if int(n.get("status", {}).get("allocatable", {}).get("nvidia.com/gpu", "0") or 0) > 0:
                return self.agent
            time.sleep(0.5)
        raise RealNodeError(f"no nvidia.com/gpu capacity on {self.name} {timeout:.0f} s after the agent started "
                            "(the device plugin registers once a VGPUPool covers the node: apply_pool()):\n"
                            f"{_tail(self.agent_log)}")

    @property
    def pool_name(self) -> str:
        return f"realnode-{self.name}"

    def apply_pool(self, split_count: int = 10) -> None:
        """A VGPUPool over this node's cards only (``kvgpu.io/gpu-node=true`` plus its hostname
        label: more specific than a fleet-wide pool, so it wins without a conflict); the agent
        offers devices only for pooled cards. :meth:`stop` deletes it."""
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": self.pool_name},
            "spec": {"nodeSelector": {"matchLabels": {"kvgpu.io/gpu-node": "true",
                                                      "kubernetes.io/hostname": self.name}},
                     "splitCount": split_count}}))

    def stop_agent(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.terminate()
            try:
                self.agent.wait(20)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait(10)
        self.agent = None
        self._save_state()

    def restart_agent(self, extra_args: Sequence[str] | None = None) -> subprocess.Popen[bytes]:
        self.stop_agent()
        return self.start_agent(self._agent_args if extra_args is None else extra_args)

    # ----- state ---------------------------------------------------------------------------
    def _pids(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for k, p in self._procs.items():
            if p.poll() is None:
                exe = p.args[0] if isinstance(p.args, list) else str(p.args)
                out[k] = {"pid": p.pid, "exe": str(Path(str(exe)).resolve())}
        if self.agent is not None and self.agent.poll() is None:
            out["agent"] = {"pid": self.agent.pid, "exe": str(Path(sys.executable).resolve())}
        return out

    def _save_state(self) -> None:
        if self.dir.exists():
            self.state_file.write_text(json.dumps({
                "node": self.name, "nodeIP": self.node_ip, "socket": str(self.socket),
                "containerdBin": str(self.containerd_bin), "kubeletLog": str(self.kubelet_log),
                "components": self._pids()}, indent=2))

    def _host_state(self) -> dict[str, Any]:
        return {"runDir": str(self.cluster.run_dir), "pids": self._pids(), "runcRoot": str(self.runc_root),
                "shim": str(self.containerd_bin / "containerd-shim-runc-v2") if self.containerd_bin else "",
                "mountRoots": [str(self.dir)]}

    def _save_host_state(self) -> None:
        HOST_STATE.write_text(json.dumps(self._host_state(), indent=2))


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


RUNC_DEBUG_WRAPPER = """#!/bin/sh
# runc wrapper (RealNode(runc_debug=True)): keeps each bundle's config.json, and runc's debug log
# of every failed call, in @DIR@ (fail.log).
d=@DIR@; b=""; prev=""
for a in "$@"; do [ "$prev" = "--bundle" ] && b="$a"; prev="$a"; done
[ -n "$b" ] && cp "$b/config.json" "$d/$(basename "$b").json" 2>/dev/null
@RUNC@ --debug "$@"; rc=$?
if [ $rc -ne 0 ] && [ -n "$b" ]; then
  echo "== rc=$rc $*" >> $d/fail.log; cat "$b/log.json" >> $d/fail.log 2>/dev/null
fi
exit $rc
"""
