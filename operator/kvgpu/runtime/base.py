"""What the parts of the operator's main process share: :class:`OperatorConfig` and
:class:`RuntimeBase` (the state and tasks of one process), with the two calls every part makes:
:meth:`~RuntimeBase.nudge_pending` and :meth:`~RuntimeBase.quotas`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web

from kvgpu import faults
from kvgpu.extender import tls
from kvgpu.extender.choice import NodeChoice
from kvgpu.extender.server import Extender
from kvgpu.extender.tls import DEFAULT_ALLOWED_CLIENTS
from kvgpu.metrics import OperatorMetrics
from kvgpu.reconcile.state import OperatorState
from kvgpu.watch import ListWatch

log = structlog.get_logger("kvgpu.operator")


@dataclass
class OperatorConfig:
    """How to run the operator. Ports 0 = pick a free one (dev/tests)."""

    kubeconfig: str | None = None  # None: in-cluster service account
    extender_host: str = "127.0.0.1"
    extender_port: int = 8888
    # Mutual TLS on the extender port (kvgpu.extender.tls): serving cert/key, the CA that signs
    # the clients' certificates, and the identities (CN or DNS/URI SAN) answered. All three
    # files are required unless extender_insecure (plain HTTP, no client check: dev/bench only).
    extender_cert: str | None = None
    extender_key: str | None = None
    extender_client_ca: str | None = None
    extender_allowed_clients: tuple[str, ...] = DEFAULT_ALLOWED_CLIENTS
    extender_insecure: bool = False
    # Plain HTTP port for /healthz, /readyz and /metrics only (kubelet probes, Prometheus).
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: not served (0: any free port)
    webhook_port: int | None = None  # None: no admission webhooks served
    webhook_host: str = "127.0.0.1"
    webhook_cert: str | None = None
    webhook_key: str | None = None
    webhook_ca: str | None = None  # PEM bundle the API server uses to trust the webhook
    webhook_workers: int = 2  # processes serving admission (kvgpu.admission.server)
    dev_webhook_configurations: bool = False  # create the webhook configurations pointing at us
    exclude_namespaces: tuple[str, ...] = ()
    operator_usernames: tuple[str, ...] = ()
    standalone: bool = True
    priority: int = 0
    peering_name: str = "kvgpu"
    sweep_interval_s: float = 15.0
    flush_interval_s: float = 0.5
    pool_status_interval_s: float = 5.0  # allocation totals in VGPUPool status, at most this often
    orphan_grace_s: float = 30.0
    bind_events: bool = False  # a GPUSlicesBound Event per pod (posted by the claim-phase worker)
    node_choice: NodeChoice = NodeChoice.EXTENDER  # who picks a GPU pod's node (kvgpu.extender.choice)
    ready_file: str | None = None  # written with the extender URL once ready
    # Leader election on a Lease: every replica watches (a warm standby), only the leader
    # answers the extender, reports ready and writes. Losing the lease ends the process.
    leader_elect: bool = False
    lease_namespace: str = "kvgpu-system"
    lease_name: str = "kvgpu-operator"
    identity: str = ""  # default: host name + PID
    lease_duration_s: int = 15


@dataclass
class RuntimeBase:
    """The fields of :class:`kvgpu.runtime.Runtime`; its methods come from the parts of the
    package (watches, background, lease, children, main), each a subclass of this."""

    cfg: OperatorConfig
    state: OperatorState = field(default_factory=OperatorState)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    api: Any = None
    extender: Extender | None = None
    extender_port: int = 0
    metrics_port: int = 0  # the plain probe/metrics port, once listening (0: none)
    pools_dirty: bool = True  # a pool or the leadership changed: write pool status at the next flush
    _pool_usage_dirty: bool = False  # allocations changed: pool status within pool_status_interval_s
    _pool_status_due: float = 0.0  # time.monotonic() before which allocation-only changes wait
    _runner: web.AppRunner | None = None
    _probe_runner: web.AppRunner | None = None
    _tls_reloader: tls.Reloader | None = None
    _webhook_procs: list[Any] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _checks: set[asyncio.Task[None]] = field(default_factory=set)  # releases waiting on a pod read
    _nudge: asyncio.Event = field(default_factory=asyncio.Event)
    # nodes that still carry the kvgpu.io/allocation annotation of an earlier version (removed by the flush)
    stale_allocation_nodes: set[str] = field(default_factory=set)
    _written_pools: dict[str, dict[str, Any]] = field(default_factory=dict)
    _phase_worker: Any = None  # the claim-phase worker process while leading
    _topology: dict[str, tuple[int, int, frozenset[str]]] | None = None
    _clash: dict[str, dict[str, set[str]]] = field(default_factory=dict)  # pool -> tied pool -> nodes
    ready_event: asyncio.Event = field(default_factory=asyncio.Event)
    active: bool = True  # False on a standby replica (leader election)
    watches: dict[str, ListWatch] = field(default_factory=dict)
    fault_log: faults.FaultLog = field(default_factory=lambda: faults.FaultLog(log))
    quota_sync: Any = None  # kvgpu.reconcile.quotas.QuotaSync, made on first use (quotas())

    def __post_init__(self) -> None:
        self.metrics.export_quotas(lambda: self.state.quotas)

    def quotas(self) -> Any:
        """The namespace-quota adapter (:class:`kvgpu.reconcile.quotas.QuotaSync`)."""
        if self.quota_sync is None:
            from kvgpu.reconcile.quotas import QuotaSync

            self.quota_sync = QuotaSync(self.state, self.nudge_pending)
        return self.quota_sync

    def nudge_pending(self, why: str) -> None:
        if self.state.pending:
            self._nudge.set()
