"""Start and stop a real local control plane: etcd, kube-apiserver, kube-scheduler(s) and
kube-controller-manager, all from the ``ktp`` multi-call binary (hack/ktp).

Every component listens on a free loopback port; PKI, kubeconfigs, data and logs live in one
run directory; ``cluster.json`` there records the PIDs so another process (``kvgpu dev down``)
can stop what this one started. Processes are stopped by PID, and only after checking that the
PID still runs the binary we started (PID reuse).

Errors: :class:`ClusterError` with the component's log tail when something does not start.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgpu.devcluster.pki import make_pki

REPO_ROOT = Path(__file__).resolve().parents[3]
KTP_BUILD = REPO_ROOT / "hack" / "ktp" / "build.sh"
READY_TIMEOUT_S = 120.0


class ClusterError(RuntimeError):
    """A control-plane component failed to build, start or become ready."""


def ensure_binaries() -> Path:
    """Return the directory with ``ktp`` and its component symlinks, building it if needed.

    ``KVGPU_KTP_BIN`` overrides (a directory holding ``kube-apiserver`` etc.). The build is
    cached outside the work tree (hack/ktp/build.sh), so this is instant once built.
    """
    env = os.environ.get("KVGPU_KTP_BIN")
    if env:
        return Path(env)
    if not KTP_BUILD.exists():
        raise ClusterError(f"{KTP_BUILD} not found; set KVGPU_KTP_BIN to a directory with kube-apiserver")
    proc = subprocess.run([str(KTP_BUILD)], stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise ClusterError(f"building the control plane failed (exit {proc.returncode}); see the output above")
    return Path(proc.stdout.strip().splitlines()[-1])


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, never one this process was given before: the ports of
    one system (an in-cluster install's five host ports, say) are distinct, where the kernel may
    hand the same free port to two successive asks."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


@dataclass
class Component:
    name: str
    pid: int
    log: str
    port: int = 0


@dataclass
class Cluster:
    """One local control plane in ``run_dir``. Use :meth:`start`/:meth:`stop` or ``with``."""

    run_dir: Path
    bin_dir: Path = field(default_factory=ensure_binaries)
    with_controller_manager: bool = True
    detached: bool = False  # True: components outlive this process (kvgpu dev up)
    #: kube-schedulers answer ``/debug/pprof`` without authentication (loopback only; for
    #: ``bench/scale/run.py --scheduler-profile`` and ``--scheduler-trace``)
    open_scheduler_pprof: bool = False
    api_port: int = 0
    components: dict[str, Component] = field(default_factory=dict)
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)
    _argv: dict[str, list[str]] = field(default_factory=dict, repr=False)

    # ----- paths -------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.run_dir / "admin.kubeconfig"

    @property
    def operator_kubeconfig(self) -> Path:
        """Kubeconfig of the ``kvgpu-operator`` identity (user name ``kvgpu-operator``)."""
        return self.run_dir / "operator.kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def state_file(self) -> Path:
        return self.run_dir / "cluster.json"

    def log(self, component: str) -> Path:
        return self.run_dir / "logs" / f"{component}.log"

    # ----- lifecycle -------------------------------------------------------------------------
    def start(self) -> Cluster:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        pki = make_pki(self.run_dir / "pki")
        etcd_port, peer_port = free_port(), free_port()
        self.api_port = free_port()
        try:
            self._spawn(
                "etcd",
                ["etcd", f"--data-dir={self.run_dir / 'etcd'}", "--name=kvgpu-dev",
                 f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                 f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                 f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                 f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                 f"--initial-cluster=kvgpu-dev=http://127.0.0.1:{peer_port}",
                 "--unsafe-no-fsync=true", "--log-level=warn", "--quota-backend-bytes=8589934592"],
                port=etcd_port,
            )
            self._wait_http(f"http://127.0.0.1:{etcd_port}/health", "etcd", tls=False)
            self._spawn(
                "kube-apiserver",
                ["kube-apiserver", f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                 "--bind-address=127.0.0.1", f"--secure-port={self.api_port}",
                 "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
                 f"--tls-cert-file={pki.path('serving.crt')}", f"--tls-private-key-file={pki.path('serving.key')}",
                 f"--client-ca-file={pki.path('ca.crt')}",
                 "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                 f"--service-account-key-file={pki.path('sa.pub')}",
                 f"--service-account-signing-key-file={pki.path('sa.key')}",
                 "--service-cluster-ip-range=10.0.0.0/24", "--authorization-mode=Node,RBAC",
                 "--allow-privileged=true",
                 "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
                 f"--cert-dir={self.run_dir / 'pki'}", "--profiling=true",  # /debug/pprof, for bench/scale
                 "--max-requests-inflight=2000", "--max-mutating-requests-inflight=1000",
                 "--enable-priority-and-fairness=false",
                 # a real node (realnode.py) is reached at its InternalIP; its name does not resolve
                 "--kubelet-preferred-address-types=InternalIP,Hostname",
                 # no kube-proxy: webhook (and aggregated API) Services are reached at their
                 # endpoints, e.g. an in-cluster operator with hostNetwork (devcluster.incluster)
                 "--enable-aggregator-routing=true", "--v=1"],
                port=self.api_port,
            )
            self._write_kubeconfig(self.kubeconfig, "admin")
            self._write_kubeconfig(self.operator_kubeconfig, "kvgpu-operator")
            self._wait_http(f"{self.server}/readyz", "kube-apiserver", tls=True)
            self._wait_default_namespace()
            if self.with_controller_manager:
                port = free_port()
                self._spawn(
                    "kube-controller-manager",
                    ["kube-controller-manager", f"--kubeconfig={self.kubeconfig}", "--leader-elect=false",
                     f"--root-ca-file={pki.path('ca.crt')}",
                     f"--service-account-private-key-file={pki.path('sa.key')}",
                     "--use-service-account-credentials=false",
                     "--controllers=*,-node-lifecycle-controller,-node-ipam-controller,-service-lb-controller,"
                     "-node-route-controller,-cloud-node-lifecycle-controller,-persistentvolume-binder-controller,"
                     "-persistentvolume-attach-detach-controller,-persistentvolume-expander-controller,-ephemeral-volume-controller",
                     "--bind-address=127.0.0.1", f"--secure-port={port}", "--concurrent-gc-syncs=5",
                     "--kube-api-qps=200", "--kube-api-burst=400", "--v=1"],
                    port=port,
                )
                self._wait_http(f"https://127.0.0.1:{port}/healthz", "kube-controller-manager",
                                tls=True, verify=False)
            self.start_scheduler("default-scheduler")
        except BaseException:
            self.stop()
            raise
        self._save_state()
        return self

    def start_scheduler(self, scheduler_name: str, config: dict[str, Any] | None = None) -> Component:
        """Start a kube-scheduler. Without ``config`` it runs one plain profile named
        ``scheduler_name``; with one (a ``KubeSchedulerConfiguration`` dict, e.g. from
        :func:`kvgpu.extender.schedconfig.scheduler_configuration`) it runs that, pointed at
        this cluster. The component is named ``kube-scheduler-<scheduler_name>``."""
        comp = f"kube-scheduler-{scheduler_name}"
        if comp in self._procs:
            raise ClusterError(f"{comp} already runs")
        port = free_port()
        cfg: dict[str, Any] = dict(config) if config else {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"qps": 500, "burst": 1000},
            "profiles": [{"schedulerName": scheduler_name}],
            "parallelism": 16,
        }
        cfg["clientConnection"] = {**cfg.get("clientConnection", {}), "kubeconfig": str(self.kubeconfig)}
        cfg["leaderElection"] = {"leaderElect": False}
        cfg_path = self.run_dir / f"{comp}.yaml"
        cfg_path.write_text(json.dumps(cfg, indent=2))  # JSON is YAML
        c = self._spawn(
            comp,
            ["kube-scheduler", f"--config={cfg_path}", "--bind-address=127.0.0.1", f"--secure-port={port}",
             "--v=1", *(["--authorization-always-allow-paths=/healthz,/readyz,/livez,/debug/pprof/*"]
                        if self.open_scheduler_pprof else [])],
            port=port,
        )
        self._wait_http(f"https://127.0.0.1:{port}/healthz", comp, tls=True, verify=False)
        self._save_state()
        return c

    def stop_component(self, name: str, timeout: float = 20.0) -> None:
        proc = self._procs.pop(name, None)
        comp = self.components.pop(name, None)
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        elif comp is not None:
            _stop_pid(comp.pid, self.bin_dir, timeout)
        self._save_state()

    def restart_component(self, name: str, *, down_s: float = 0.0) -> Component:
        """Stop a component this object started and start it again with the same command line
        (same ports, data and flags), after ``down_s`` seconds; returns once it is healthy.
        For fault-injection tests (e.g. an API server restart in the middle of a burst)."""
        if name not in self._argv:
            raise ClusterError(f"{name} was not started by this Cluster object; cannot restart it")
        argv, port = self._argv[name], self.components[name].port
        self.stop_component(name)
        if down_s:
            time.sleep(down_s)
        comp = self._spawn(name, argv, port=port)
        if name == "etcd":
            self._wait_http(f"http://127.0.0.1:{port}/health", name, tls=False)
        elif name == "kube-apiserver":
            self._wait_http(f"{self.server}/readyz", name, tls=True)
        else:
            self._wait_http(f"https://127.0.0.1:{port}/healthz", name, tls=True, verify=False)
        self._save_state()
        return comp

    def stop(self) -> None:
        """Stop every component we started, newest first, by PID."""
        for name in reversed(list({**self.components, **{k: None for k in self._procs}})):
            self.stop_component(name)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----- clients ---------------------------------------------------------------------------
    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl (same minor as the server) against this cluster."""
        cmd = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        p = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False)
        if check and p.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
        return p

    @contextmanager
    def env(self) -> Iterator[dict[str, str]]:
        """Environment with KUBECONFIG and kubectl on PATH, for subprocesses."""
        e = dict(os.environ)
        e["KUBECONFIG"] = str(self.kubeconfig)
        e["PATH"] = f"{self.bin_dir}{os.pathsep}{e.get('PATH', '')}"
        yield e

    def api(self) -> Any:
        """An async context manager yielding a kubernetes_asyncio ``ApiClient`` for this cluster."""
        from kvgpu.devcluster.client import api_client

        return api_client(self.kubeconfig)

    # ----- internals -------------------------------------------------------------------------
    def _spawn(self, name: str, argv: Sequence[str], *, port: int = 0) -> Component:
        log_path = self.log(name)
        log = log_path.open("ab")
        exe = self.bin_dir / argv[0]
        proc = subprocess.Popen(
            [str(exe), *argv[1:]], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=self.run_dir, start_new_session=True, preexec_fn=None if self.detached else die_with_parent,
        )
        log.close()
        self._procs[name] = proc
        self._argv[name] = list(argv)
        comp = Component(name, proc.pid, str(log_path), port)
        self.components[name] = comp
        return comp

    def _tail(self, name: str, lines: int = 25) -> str:
        try:
            return "\n".join(self.log(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.run_dir / "pki" / "ca.crt"))
        ctx.load_cert_chain(str(self.run_dir / "pki" / "admin.crt"), str(self.run_dir / "pki" / "admin.key"))
        return ctx

    def _wait_http(
        self, url: str, name: str, *, tls: bool, verify: bool = True, timeout: float = READY_TIMEOUT_S
    ) -> None:
        deadline = time.monotonic() + timeout
        ctx = self._ssl() if tls else None
        if ctx is not None and not verify:  # components' own self-signed serving certs
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        last = ""
        while time.monotonic() < deadline:
            proc = self._procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise ClusterError(f"{name} exited with {proc.returncode}; log tail:\n{self._tail(name)}")
            try:
                with urllib.request.urlopen(url, timeout=5, context=ctx) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            time.sleep(0.25)
        raise ClusterError(f"{name} not ready at {url} after {timeout:.0f} s ({last}); log tail:\n{self._tail(name)}")

    def _wait_default_namespace(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.kubectl("get", "namespace", "default", "-o", "name", check=False).returncode == 0:
                return
            time.sleep(0.25)
        raise ClusterError("namespace 'default' never appeared")

    def _write_kubeconfig(self, path: Path, user: str) -> None:
        pki = self.run_dir / "pki"
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "kvgpu-dev",
            "clusters": [{"name": "kvgpu-dev", "cluster": {
                "server": self.server, "certificate-authority-data": _b64((pki / "ca.crt").read_bytes())}}],
            "users": [{"name": user, "user": {
                "client-certificate-data": _b64((pki / f"{user}.crt").read_bytes()),
                "client-key-data": _b64((pki / f"{user}.key").read_bytes())}}],
            "contexts": [{"name": "kvgpu-dev", "context": {"cluster": "kvgpu-dev", "user": user}}],
        }
        path.write_text(json.dumps(cfg, indent=2))
        path.chmod(0o600)

    def _save_state(self) -> None:
        if not self.run_dir.exists():
            return
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "binDir": str(self.bin_dir),
            "components": {k: vars(v) for k, v in self.components.items()},
        }
        self.state_file.write_text(json.dumps(state, indent=2))

    @classmethod
    def attach(cls, run_dir: Path) -> Cluster:
        """Re-open a cluster started by another process (for ``kvgpu dev down``/status)."""
        state = json.loads((run_dir / "cluster.json").read_text())
        c = cls(run_dir=run_dir, bin_dir=Path(state["binDir"]), with_controller_manager=False)
        c.api_port = int(state["server"].rsplit(":", 1)[1])
        c.components = {k: Component(**v) for k, v in state["components"].items()}
        return c

    def alive(self) -> dict[str, bool]:
        return {k: _pid_runs(v.pid, self.bin_dir) for k, v in self.components.items()}


def die_with_parent() -> None:
    """In a child before exec: ask Linux to SIGKILL it when the process that started it dies
    (prctl PR_SET_PDEATHSIG), so a test run that is itself killed leaves nothing behind."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def _pid_runs(pid: int, bin_dir: Path) -> bool:
    """True if ``pid`` is alive and still runs our ktp binary (guards against PID reuse)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return Path(exe).resolve() == (bin_dir / "ktp").resolve()


def _stop_pid(pid: int, bin_dir: Path, timeout: float) -> None:
    if not _pid_runs(pid, bin_dir):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_runs(pid, bin_dir):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
