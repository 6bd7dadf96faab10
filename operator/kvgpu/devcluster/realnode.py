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

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvgpu.devcluster import images, nodeconfig
from kvgpu.devcluster.cluster import REPO_ROOT, Cluster, ClusterError, die_with_parent

# The host helpers live in kvgpu.devcluster.realhost; their public names stay importable here.
from kvgpu.devcluster.realhost import *  # noqa: F403
from kvgpu.devcluster.realhost import (
    HOST_STATE,
    KUBELET_ROOT,
    NODE_BRIDGE,
    READY_TIMEOUT_S,
    SHIM_SOURCE,
    SOCKET_DIR,
    RealNodeError,
    RealNodeUnavailable,
    _ip,
    _link_exists,
    _umount_under,
    clean_host,
    cni_bin_dir,
    ensure_containerd,
    host_addresses,
    leftovers,
    release_host_lock,
    take_host_lock,
)


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
    def cdi_dir(self) -> Path:
        """containerd's CDI spec directory (``cdi_spec_dirs``): the agent's DRA plugin writes there."""
        return self.dir / "cdi"

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
        cni = cni_bin_dir()
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

    def _take_lock(self) -> None:
        self._lock = take_host_lock(f"pid {os.getpid()} run dir {self.cluster.run_dir}")

    def _release_lock(self) -> None:
        if self._lock is not None:
            release_host_lock(self._lock)
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
        nodeconfig.write_simulated_cards(self.name, self.cards, self.driver_root, self.dev_root, self.sim_file)

    def _write_containerd_config(self) -> None:
        assert self.containerd_bin is not None
        wrapper = None
        if self.runc_debug:
            wrapper = self.dir / "runc-debug.sh"
            wrapper.write_text(nodeconfig.runc_debug_wrapper(self.dir / "runc-debug", shutil.which("runc") or "runc"))
            wrapper.chmod(0o755)
        (self.dir / "containerd" / "config.toml").write_text(
            nodeconfig.containerd_config(self.dir, self.socket, self.runc_root, cni_bin_dir(), wrapper))

    def _write_cni(self) -> None:
        (self.dir / "cni" / "net.d" / "10-kvgpu.conflist").write_text(nodeconfig.cni_conflist(self.pod_cidr))

    def _write_kubelet_config(self) -> None:
        (self.dir / "kubelet" / "config.yaml").write_text(
            nodeconfig.kubelet_config(self.socket, self.node_ip, self.pod_cidr))

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
                "--metrics-port", "0", "--driver-root", str(self.driver_root), "--dev-root", str(self.dev_root),
                "--cdi-dir", str(self.cdi_dir)]
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

    def apply_pool(self, split_count: int = 10, allocation: str = "extender", mode: str = "hami-core") -> None:
        """A VGPUPool over this node's cards only (``kvgpu.io/gpu-node=true`` plus its hostname
        label: more specific than a fleet-wide pool, so it wins without a conflict); the agent
        offers devices only for pooled cards (``allocation``: ``extender``, the device plugin,
        or ``dra``, the node's ResourceSlice; ``mode``: ``hami-core``, ``exclusive`` or ``mps``).
        :meth:`stop` deletes it."""
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": self.pool_name},
            "spec": {"nodeSelector": {"matchLabels": {"kvgpu.io/gpu-node": "true",
                                                      "kubernetes.io/hostname": self.name}},
                     "splitCount": split_count, "allocation": allocation, "mode": mode}}))

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

