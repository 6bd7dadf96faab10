"""The whole kvgpu system on a local :class:`Cluster`: CRDs, the operator as a separate
process (``kvgpu operator``, its own identity, webhooks on loopback), and a second
kube-scheduler (profile ``kvgpu-scheduler``) wired to the operator's extender.

Used by the end-to-end tests and ``make demo``. The operator can be killed and restarted
(:meth:`KvgpuSystem.kill_operator`, :meth:`start_operator`) to test crash recovery.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvgpu.devcluster.cluster import REPO_ROOT, Cluster, ClusterError, die_with_parent, free_port
from kvgpu.extender.schedconfig import scheduler_configuration

CRD_DIR = REPO_ROOT / "crds"


@dataclass
class KvgpuSystem:
    cluster: Cluster
    extender_port: int = field(default_factory=free_port)
    webhook_port: int = field(default_factory=free_port)
    operator: subprocess.Popen[bytes] | None = None
    starts: int = 0
    operator_args: tuple[str, ...] = ()  # more `kvgpu operator` options, e.g. ("--node-choice=scheduler",)

    def install_crds(self) -> None:
        self.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_DIR))
        self.cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")

    def start(self) -> KvgpuSystem:
        self.install_crds()
        self.start_operator()
        url = f"http://127.0.0.1:{self.extender_port}/scheduler"
        self.cluster.start_scheduler("kvgpu-scheduler", scheduler_configuration(url))
        return self

    @property
    def ready_file(self) -> Path:
        return self.cluster.run_dir / "operator.ready"

    def operator_log(self) -> Path:
        return self.cluster.log(f"kvgpu-operator-{self.starts}")

    def start_operator(self, timeout: float = 120) -> None:
        if self.operator is not None and self.operator.poll() is None:
            raise ClusterError("the operator already runs")
        self.ready_file.unlink(missing_ok=True)
        self.starts += 1
        pki = self.cluster.run_dir / "pki"
        argv = [
            sys.executable, "-m", "kvgpu.cli.main", "operator",
            f"--kubeconfig={self.cluster.operator_kubeconfig}",
            f"--extender-address=127.0.0.1:{self.extender_port}",
            f"--webhook-port={self.webhook_port}", "--webhook-host=127.0.0.1",
            f"--webhook-cert={pki / 'webhook.crt'}", f"--webhook-key={pki / 'webhook.key'}",
            f"--webhook-ca={pki / 'ca.crt'}", "--dev-webhooks", "--operator-username=kvgpu-operator",
            f"--ready-file={self.ready_file}", *self.operator_args,
        ]
        log = self.operator_log().open("ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.operator = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True,
                                         preexec_fn=None if self.cluster.detached else die_with_parent)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                return
            if self.operator.poll() is not None:
                tail = "\n".join(self.operator_log().read_text(errors="replace").splitlines()[-30:])
                raise ClusterError(f"kvgpu operator exited with {self.operator.returncode}:\n{tail}")
            time.sleep(0.1)
        raise ClusterError(f"kvgpu operator not ready after {timeout:.0f} s; see {self.operator_log()}")

    def kill_operator(self) -> None:
        """SIGKILL the operator (crash test)."""
        if self.operator is not None and self.operator.poll() is None:
            os.kill(self.operator.pid, signal.SIGKILL)
            self.operator.wait(10)

    def stop_operator(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(20)
            except subprocess.TimeoutExpired:
                self.operator.kill()
                self.operator.wait(10)

    def stop(self) -> None:
        self.cluster.stop_component("kube-scheduler-kvgpu-scheduler")
        self.stop_operator()
