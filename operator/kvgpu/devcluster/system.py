"""The whole kvgpu system on a local :class:`Cluster`: CRDs, the DRA DeviceClass, the operator as a separate
process (``kvgpu operator``, its own identity, webhooks on loopback), and a second
kube-scheduler (profile ``kvgpu-scheduler``) wired to the operator's extender.

The extender is served over mutual TLS (issue 14) with the dev PKI's extender CA
(:func:`kvgpu.devcluster.pki.make_extender_pki`): the operator gets ``--extender-cert/key`` and
``--extender-client-ca``, kube-scheduler a ``tlsConfig`` with its client certificate
(``CN=kvgpu-scheduler``). ``/healthz``, ``/readyz`` and ``/metrics`` are also on a plain port
(:attr:`KvgpuSystem.metrics_port`). ``extender_insecure=True`` gives the old plain HTTP.

Used by the end-to-end tests and ``make demo``. The operator can be killed and restarted
(:meth:`KvgpuSystem.kill_operator`, :meth:`start_operator`) to test crash recovery.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgpu.devcluster.cluster import REPO_ROOT, Cluster, ClusterError, die_with_parent, free_port
from kvgpu.dra.slices import device_classes
from kvgpu.extender.schedconfig import ExtenderTLS, scheduler_configuration

CRD_DIR = REPO_ROOT / "charts" / "kvgpu" / "crds"


@dataclass
class KvgpuSystem:
    cluster: Cluster
    extender_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)  # plain HTTP: /healthz, /readyz, /metrics
    webhook_port: int = field(default_factory=free_port)
    operator: subprocess.Popen[bytes] | None = None
    starts: int = 0
    operator_args: tuple[str, ...] = ()  # more `kvgpu operator` options, e.g. ("--node-choice=scheduler",)
    extender_insecure: bool = False  # plain HTTP extender, no client certificates (--extender-insecure)

    def install_crds(self) -> None:
        self.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_DIR))
        self.cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")

    def install_device_classes(self) -> None:
        """kvgpu's DRA DeviceClasses (:func:`kvgpu.dra.slices.device_classes`, as the chart's
        ``templates/deviceclass.yaml``)."""
        items = device_classes()
        self.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                             input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))

    def start(self) -> KvgpuSystem:
        self.install_crds()
        self.install_device_classes()
        self.start_operator()
        self.start_scheduler()
        return self

    @property
    def pki(self) -> Path:
        return self.cluster.run_dir / "pki"

    @property
    def extender_url(self) -> str:
        return self._url(self.extender_port)

    def _url(self, port: int) -> str:
        return f"{'http' if self.extender_insecure else 'https'}://127.0.0.1:{port}/scheduler"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def scheduler_tls(self) -> ExtenderTLS | None:
        """kube-scheduler's side of the extender's mutual TLS (None with extender_insecure)."""
        if self.extender_insecure:
            return None
        return ExtenderTLS(cert_file=str(self.pki / "extender-client.crt"),
                           key_file=str(self.pki / "extender-client.key"), ca_file=str(self.pki / "extender-ca.crt"))

    def scheduler_config(self, port: int | None = None) -> dict[str, Any]:
        """The kvgpu kube-scheduler's configuration, pointed at this operator's extender (or
        at ``port``, another operator served with the same flags)."""
        return scheduler_configuration(self._url(self.extender_port if port is None else port),
                                       tls=self.scheduler_tls())

    def start_scheduler(self) -> None:
        self.cluster.start_scheduler("kvgpu-scheduler", self.scheduler_config())

    def extender_args(self, port: int | None = None, metrics_port: int | None = None) -> list[str]:
        """The `kvgpu operator` options for the extender's server as this system runs it."""
        argv = [f"--extender-address=127.0.0.1:{self.extender_port if port is None else port}"]
        if metrics_port != 0:
            argv.append(f"--metrics-address=127.0.0.1:{self.metrics_port if metrics_port is None else metrics_port}")
        if self.extender_insecure:
            return [*argv, "--extender-insecure"]
        return [*argv, f"--extender-cert={self.pki / 'extender.crt'}", f"--extender-key={self.pki / 'extender.key'}",
                f"--extender-client-ca={self.pki / 'extender-ca.crt'}"]

    def client_ssl(self, stem: str = "extender-client") -> ssl.SSLContext:
        """A client context trusting the extender's serving certificate, presenting
        ``<stem>.crt/key`` of the dev PKI (default: kube-scheduler's)."""
        ctx = ssl.create_default_context(cafile=str(self.pki / "extender-ca.crt"))
        ctx.load_cert_chain(str(self.pki / f"{stem}.crt"), str(self.pki / f"{stem}.key"))
        return ctx

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
        pki = self.pki
        argv = [
            sys.executable, "-m", "kvgpu.cli.main", "operator",
            f"--kubeconfig={self.cluster.operator_kubeconfig}",
            *self.extender_args(),
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
