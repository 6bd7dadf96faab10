"""The agent process: ``kvgpu agent --node NAME [--simulated FILE] ...``.

:func:`run` is the whole agent as one coroutine; the CLI builds an :class:`AgentConfig` and calls
``asyncio.run(run(cfg))``. Order at start: discovery works (or the agent exits with
:class:`~kvgpu.agent.discovery.DiscoveryError`) → the shim is installed (when a source is given)
→ then, concurrently: inventory registration, health monitoring, the pod cache, the kubelet
device plugin (and the MIG profiles' plugins, :mod:`kvgpu.agent.migplugin`), the metrics server,
the region GC and the compute schedule writer
(:mod:`kvgpu.agent.schedule`, with the device plugin only). The prepared DRA claims
(:mod:`kvgpu.agent.draregions`) are tenants of the schedule, the exporter and the OOM reporter.
A health change re-publishes the inventory at once, updates the device plugin's list (the
kubelet sees the replicas unhealthy) and records a Node Event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from kvgpu.core import keys
from kvgpu.core.inventory import NodeInventory

from .config import AgentConfig
from .deviceplugin import DevicePlugin, PluginConfig
from .discovery import DiscoveryError, NvmlDiscovery, make_discovery
from .draclaimfiles import REGION_DIR
from .dradriver import start_dra_driver
from .draplugin import DraPlugin
from .drapublish import SlicePublisher
from .draregions import DraTenants
from .enforcement import (
    EnforcementMonitor,
    ProcessUtilization,
    ProcessView,
    SmMeans,
    attribute,
    nvml_processes,
    proc_start_time,
    set_region_host_pid,
)
from .escapes import ACTIONS as ESCAPE_ACTIONS
from .escapes import Backstop, Kill
from .exporter import UsageCollector, make_registry, serve
from .hamiview import HostCard, node_allocation, nvml_host_cards
from .health import (
    APPLICATION_XIDS,
    HealthChange,
    HealthMonitor,
    HealthState,
    NvmlHealthSource,
    SimulatedHealthSource,
)
from .kube import KubeApi, NodeApi
from .migplugin import MigPlugins, simulated_node_resources
from .mps import MpsDaemons, MpsOwner, mps_cards, write_wanted
from .oomkill import REASON as OOM_REASON
from .oomkill import OomReporter
from .podidentity import PodIdentifier
from .podresources import PodResourcesClient
from .pods import PodCache
from .registration import Registrar
from .schedule import Scheduler, sources_of
from .shimcheck import ShimCheck
from .shiminstall import install_shim, prune_shims
from .slotresolver import SlotResolver
from .usage import REGION_FILE, BoundContainer, default_reader, gc_regions

log = logging.getLogger(__name__)


@asynccontextmanager
async def kube_client(kubeconfig: str | None) -> AsyncIterator[Any]:
    """A kubernetes_asyncio ``ApiClient`` from a kubeconfig file or the in-cluster account."""
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    if kubeconfig:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        config.load_incluster_config(client_configuration=cfg)
    async with client.ApiClient(configuration=cfg) as api:
        yield api


class Agent:
    """The running agent's parts (exposed for tests and the demo)."""

    def __init__(self, cfg: AgentConfig, api: NodeApi, api_client: Any | None = None) -> None:
        if not cfg.node:
            raise ValueError("the agent needs a node name (--node or NODE_NAME)")
        self.cfg = cfg
        self.api = api
        self.api_client = api_client
        self.discovery = make_discovery(cfg.node, cfg.simulated)
        self.health = HealthState(
            [], recovery_s=cfg.recovery_s, ignored_xids=APPLICATION_XIDS | frozenset(cfg.extra_ignored_xids)
        )
        self.shim_check: ShimCheck | None = None  # set once the shim is installed (start_checks)
        self.registrar = Registrar(cfg.node, api, self.discovery, self.health, extra=self._shim_annotation)
        self.pods = PodCache(cfg.node)
        self.plugin: DevicePlugin | None = None
        self.mig_plugins: MigPlugins | None = None  # nvidia.com/mig-<profile>, with the device plugin
        self.metrics_server: Any = None
        self.reader = default_reader()
        self.enforcement: EnforcementMonitor | None = None
        self.backstop: Backstop | None = None
        self.scheduler: Scheduler | None = None
        self.oom: OomReporter | None = None
        self._capacity: dict[str, tuple[int, int]] = {}  # simulated node: resource → (capacity, allocatable)
        self.mps: MpsOwner | None = None  # the daemons' owner when this agent is it
        self._mps_kick = asyncio.Event()
        self.dra: DraPlugin | None = None
        self.slices: SlicePublisher | None = None
        self.slot_resolver: SlotResolver | None = None
        # the prepared DRA claims: tenants of the schedule, the exporter and the OOM reporter
        self.dra_tenants = DraTenants(lambda: self.dra.files if self.dra else None, self.pods.all_pods)

    def inventory(self) -> NodeInventory | None:
        return self.registrar.inventory

    def _shim_annotation(self) -> dict[str, str]:
        """``{kvgpu.io/shim: status}`` once this agent installed the shim (none before or without)."""
        return {} if self.shim_check is None else {keys.NODE_SHIM: self.shim_check.annotation()}

    async def _on_health(self, changes: list[HealthChange]) -> None:
        for ch in changes:
            if ch.healthy:
                await self.api.node_event(self.cfg.node, "GPUHealthy", f"card {ch.uuid} is healthy again")
            else:
                await self.api.node_event(
                    self.cfg.node, "GPUUnhealthy", f"card {ch.uuid}: {ch.reason}", "Warning"
                )
        self.registrar.kick()

    async def _on_inventory(self, inv: NodeInventory) -> None:
        if self.plugin is not None:
            await self.plugin.update(inv)
        if self.mig_plugins is not None:
            await self.mig_plugins.update(inv)
        if self.slices is not None:
            await self.slices.publish(inv, self.api.list_pools)
        self._mps_kick.set()
        if self.cfg.simulated and self.cfg.simulated_capacity and not self.cfg.device_plugin:
            patch = getattr(self.api, "patch_node_resource", None)
            for resource, want in simulated_node_resources(inv, self.cfg.plugin, self._capacity).items():
                if patch is not None and want != self._capacity.get(resource):
                    await patch(self.cfg.node, resource, *want)
                    self._capacity[resource] = want

    def _make_mps(self) -> MpsOwner | None:
        if self.cfg.mps_daemons != "agent":
            return None
        daemons = MpsDaemons(self.cfg.mps_root, self.cfg.mps_control, driver_root=self.cfg.plugin.driver_root)
        return MpsOwner(daemons, interval_s=self.cfg.mps_interval_s)

    def _mps_round(self, inv: NodeInventory) -> None:
        wanted = mps_cards(inv.cards)
        # A node that never had an mps card gets no files; once the root exists (the chart's
        # hostPath, an earlier mps card) the list is kept current, empty included (quit all).
        if (wanted or os.path.isdir(self.cfg.mps_root)) and write_wanted(self.cfg.mps_root, wanted):
            log.info("MPS cards wanted: %s", ", ".join(wanted) or "none")
        if self.mps is not None and (wanted or self.mps.daemons.found()):
            self.mps.round()

    async def _mps_loop(self) -> None:
        """Tell the daemons' owner which cards are mps (after each inventory and every interval)
        and, when this agent is the owner, keep them running. The daemons outlive the agent:
        they are left running when it stops."""
        while True:
            inv = self.registrar.inventory
            if inv is not None:
                try:
                    await asyncio.to_thread(self._mps_round, inv)
                except Exception:  # a missing control program, a full disk: retried next round
                    log.exception("MPS daemon check failed")
            self._mps_kick.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._mps_kick.wait(), self.cfg.mps_interval_s)

    def _health_source(self) -> Any:
        if self.cfg.simulated:
            return SimulatedHealthSource(
                lambda: self.registrar.last_raw or NodeInventory(self.cfg.node, ()),
                self.cfg.simulated_health,
                interval_s=min(self.cfg.health_probe_s, 5.0),
            )
        nv = self.discovery.nvml if isinstance(self.discovery, NvmlDiscovery) else None
        return NvmlHealthSource(
            lambda: [c.uuid for c in (self.registrar.last_raw.cards if self.registrar.last_raw else ())],
            nvml=nv,
            probe_interval_s=self.cfg.health_probe_s,
        )

    def _read_region(self, pod_uid: str, container: str) -> Any:
        from pathlib import Path

        return self.reader(Path(self.cfg.region_root) / pod_uid / container)

    def _read_dir(self, region_dir: str) -> Any:
        """The region rows of a DRA claim's region directory."""
        return self.reader(Path(region_dir))

    async def _unenforced_event(self, c: BoundContainer, message: str) -> None:
        pod_event = getattr(self.api, "pod_event", None)
        if pod_event is not None:
            await pod_event(
                c.namespace,
                c.pod,
                c.pod_uid,
                "GPUUnenforced",
                f"container {c.container} runs outside the kvgpu shim on {message}",
            )

    async def _killed_event(self, c: BoundContainer, reason: str, message: str) -> None:
        pod_event = getattr(self.api, "pod_event", None)
        if pod_event is not None:
            await pod_event(c.namespace, c.pod, c.pod_uid, reason, f"container {c.container}: {message}", "Warning")

    async def _oom_event(self, c: BoundContainer, message: str) -> None:
        pod_event = getattr(self.api, "pod_event", None)
        if pod_event is not None and c.pod:  # a DRA claim no pod consumes has nobody to tell
            await pod_event(c.namespace, c.pod, c.pod_uid, OOM_REASON, message, "Warning")

    def _card_index(self, uuid: str) -> int | None:
        inv = self.registrar.last_raw
        return next((c.index for c in (inv.cards if inv else ()) if c.uuid == uuid), None)

    def _make_oom_reporter(self) -> OomReporter:
        return OomReporter(
            self._claimed_containers,
            self._read_region,
            on_kill=self._oom_event,
            card_index=self._card_index,
            interval_s=self.cfg.oom_report_s,
            read_dir=self.reader,
        )

    def _claimed_containers(self) -> list[BoundContainer]:
        """The device plugin's containers and the prepared DRA claims' entries (exporter, OOM)."""
        return self.pods.containers() + self.dra_tenants.containers()

    async def _oom_reports(self) -> None:
        await self.pods.synced.wait()  # the first round must see every container (restart rule)
        assert self.oom is not None
        await self.oom.run()

    def _make_scheduler(self) -> Scheduler:
        from pathlib import Path

        return Scheduler(
            Path(self.cfg.sched_dir),
            lambda: sources_of(self.pods.containers(), self.cfg.region_root) + self.dra_tenants.sources(),
            lambda: [c.uuid for c in (self.registrar.last_raw.cards if self.registrar.last_raw else ())],
        )

    def _node_allocation(self, containers: list[BoundContainer]) -> dict[str, Any] | None:
        """This node's allocation per card (HAMi's scheduler view), counted from the inventory
        and ``containers``, the scrape's snapshot of the slices bound here; ``None`` before the
        first inventory. No API call: a scrape runs in the exporter's thread."""
        return node_allocation(self.registrar.inventory, containers)

    def _host_cards(self) -> Callable[[], list[HostCard]] | None:
        """NVML's per-card figures for HAMi's host series; ``None`` without NVML (simulated)."""
        if self.cfg.simulated or not isinstance(self.discovery, NvmlDiscovery):
            return None
        nv = self.discovery.nvml

        def read() -> list[HostCard]:
            inv = self.registrar.last_raw
            return nvml_host_cards(nv, [(c.uuid, c.index, c.model) for c in (inv.cards if inv else ())])

        return read

    def _make_enforcement(self) -> EnforcementMonitor | None:
        if self.cfg.simulated or not self.cfg.enforcement_s or not isinstance(self.discovery, NvmlDiscovery):
            return None
        nv = self.discovery.nvml

        def uuids() -> list[str]:
            return [c.uuid for c in (self.registrar.last_raw.cards if self.registrar.last_raw else ())]

        util, polled = ProcessUtilization(nv), ProcessUtilization(nv)  # each keeps its own last sample time
        return EnforcementMonitor(
            processes=lambda: nvml_processes(nv, uuids()),
            containers=self._enforced_containers,
            read_region=self._read_region,
            read_dir=self._read_dir,
            on_unenforced=self._unenforced_event,
            end_escapes=self._make_escapes(),
            on_killed=self._killed_event,
            host_pid_writer=self._write_host_pid,
            utilization=lambda: util(uuids()),
            sm_means=SmMeans(lambda: polled(uuids()), attribute),
            interval_s=self.cfg.enforcement_s,
        )

    def _make_escapes(self) -> Callable[[Sequence[ProcessView]], list[Kill]] | None:
        """The backstop (kvgpu.agent.escapes) of ``unenforced`` / ``over_limit`` / ``over_cores``
        ``kill`` (None when all only report). Raises ValueError for an action it does not know."""
        actions = {"unenforced": self.cfg.unenforced, "over_limit": self.cfg.over_limit,
                   "over_cores": self.cfg.over_cores}
        for name, action in actions.items():
            if action not in ESCAPE_ACTIONS:
                raise ValueError(f"{name}={action!r} is not one of {ESCAPE_ACTIONS}")
        if "kill" not in actions.values():
            return None
        backstop = self.backstop = Backstop(
            grace_s=self.cfg.unenforced_grace_s, unenforced=self.cfg.unenforced == "kill",
            over_limit=self.cfg.over_limit == "kill", slack_mib=self.cfg.over_limit_slack_mib,
            over_cores=self.cfg.over_cores == "kill", cores_slack_pts=self.cfg.over_cores_slack_pts,
            cores_grace_s=self.cfg.over_cores_grace_s, time_shared=self._time_shared_cards,
            container_sm=lambda: self.enforcement.container_sm if self.enforcement is not None else {})

        def end(views: Sequence[ProcessView]) -> list[Kill]:
            backstop.forget({(c.pod_uid, c.container) for c in self._enforced_containers()})
            return backstop.end(views)

        return end

    def _time_shared_cards(self) -> set[str]:
        """The node's cards in ``hami-core`` pools: cores there are a share of the card's time."""
        inv = self.inventory()
        return {c.uuid for c in (inv.cards if inv else ()) if c.slicing is not None and c.slicing.mode == "hami-core"}

    def _enforced_containers(self) -> list[BoundContainer]:
        """What the enforcement check judges: the device plugin's containers and each container
        consuming a prepared DRA claim (its own entry, with its runtime ID)."""
        try:
            dra = self.dra_tenants.enforced()
        except Exception as e:  # a claim unprepared while its files were listed: next pass
            log.warning("DRA claims not read for the enforcement check: %s", e)
            dra = []
        return self.pods.containers() + dra

    def _write_host_pid(self, c: BoundContainer, inner_pid: int, host_pid: int) -> bool:
        region = Path(c.region_dir) if c.region_dir else Path(self.cfg.region_root) / c.pod_uid / c.container
        return set_region_host_pid(region / REGION_FILE, inner_pid, host_pid, proc_start_time(host_pid))

    def _region_files(self) -> list[Path]:
        """Every region this agent made: containers' (extender mode) and prepared DRA claims'."""
        files = sorted(Path(self.cfg.region_root).glob(f"*/*/{REGION_FILE}"))
        claim_files = self.dra.files if self.dra is not None else None
        if claim_files is not None:
            files += [claim_files.dir(uid) / REGION_DIR / REGION_FILE for uid in claim_files.prepared_uids()]
        return files

    async def _region_gc(self) -> None:
        await self.pods.synced.wait()
        while True:
            removed = await asyncio.to_thread(
                gc_regions, self.cfg.region_root, self.pods.live_uids(), self.cfg.region_gc_s
            )
            for p in removed:
                log.info("removed shared-region dir of a pod no longer on this node: %s", p.name)
            await asyncio.sleep(self.cfg.region_gc_s)

    def _identifier(self, plugin_cfg: PluginConfig) -> PodIdentifier | None:
        """Who the kubelet admits: from the pod cache, fresh lists and PodResources (needs the API)."""
        api_client = self.api_client
        if api_client is None:
            return None
        prc = PodResourcesClient(plugin_cfg.resource_name, self.cfg.pod_resources_socket)
        return PodIdentifier(
            self.cfg.node,
            plugin_cfg.resource_name,
            cached=self.pods.all_pods,
            lookup=prc.lookup,
            lookup_many=prc.lookup_many,
            fresh=lambda: self.pods.list_fresh(api_client),
        )

    async def start_checks(self) -> NodeInventory:
        """Discovery once (fail fast) and the shim installation. Raises DiscoveryError/ShimInstallError."""
        inv = await asyncio.to_thread(self.discovery.discover)
        self.registrar.last_raw = inv
        log.info("discovered %d card(s) on %s (%s)", len(inv.cards), self.cfg.node, inv.source)
        if self.cfg.shim_source:
            r = install_shim(
                self.cfg.shim_source,
                self.cfg.shim_version,
                self.cfg.host_shim_dir,
                self.cfg.host_preload_file,
            )
            log.info("shim %s: %s (%s)", r.version, r.action, r.path.name)
            self.shim_check = ShimCheck(self.cfg.host_shim_dir, r.version, r.sha256)
            for p in prune_shims(self.cfg.host_shim_dir, keep=self.cfg.shim_keep, region_root=self.cfg.region_root):
                log.info("pruned unused shim %s", p.name)
        return inv

    async def run(self) -> None:
        """Run every part until cancelled (a crashing part cancels the others and re-raises)."""
        inv = await self.start_checks()
        async with asyncio.TaskGroup() as tg:
            if self.cfg.device_plugin:
                # The plugin serves what this agent installs.
                plugin_cfg = dataclasses.replace(
                    self.cfg.plugin,
                    host_shim_dir=self.cfg.host_shim_dir,
                    host_preload_file=self.cfg.host_preload_file,
                    stub_driver_env=self.cfg.simulated is not None,
                    region_root=self.cfg.region_root,
                    sched_dir=self.cfg.sched_dir,
                )
                self.plugin = DevicePlugin(
                    plugin_cfg, inv, hints=self.pods.hints, identifier=self._identifier(plugin_cfg)
                )
                tg.create_task(self.plugin.run(), name="device-plugin")
                self.mig_plugins = MigPlugins(plugin_cfg, inv)
                tg.create_task(self.mig_plugins.run(), name="mig-device-plugins")
                if self.cfg.dra is not None and self.api_client is not None:
                    self.dra, self.slices = start_dra_driver(tg, self.cfg.node, self.cfg.dra, plugin_cfg,
                                                             self.api_client, self.inventory, self.registrar.kick)
            if isinstance(self.api, KubeApi):
                tg.create_task(self.api.watch(self.cfg.node, self.registrar.kick), name="node-pool-watch")
            tg.create_task(self.registrar.run(self.cfg.interval_s, self._on_inventory), name="registration")
            if self.cfg.health:
                mon = HealthMonitor(self.health, self._health_source(), self._on_health)
                tg.create_task(mon.run(), name="health")
            if self.api_client is not None:
                tg.create_task(self.pods.run(self.api_client), name="pods")
                tg.create_task(self._region_gc(), name="region-gc")
                if self.cfg.oom_report_s > 0:
                    self.oom = self._make_oom_reporter()
                    tg.create_task(self._oom_reports(), name="oom-reports")
            if self.cfg.device_plugin and self.cfg.sched_interval_s > 0:
                self.scheduler = self._make_scheduler()
                tg.create_task(self.scheduler.run(self.cfg.sched_interval_s), name="compute-schedule")
            if self.cfg.device_plugin and self.cfg.mps_interval_s > 0:
                self.mps = self._make_mps()
                tg.create_task(self._mps_loop(), name="mps-daemons")
            if self.cfg.device_plugin and self.cfg.region_root:
                # Slots of other PID namespaces (a shared DRA claim): the shim reaps them only on
                # this agent's word. Runs without NVML too (it reads /proc and the regions).
                self.slot_resolver = SlotResolver(self._region_files, self.cfg.enforcement_s or 5.0)
                tg.create_task(self.slot_resolver.run(), name="region-slots")
            self.enforcement = self._make_enforcement()
            if self.enforcement is not None:
                tg.create_task(self.enforcement.run(), name="enforcement")
            if self.cfg.metrics_port:
                collector = UsageCollector(
                    self.cfg.node,
                    self._claimed_containers,
                    self.inventory,
                    reader=self.reader,
                    region_root=self.cfg.region_root,
                    hami_compat=self.cfg.hami_metrics,
                    processes=(lambda: self.enforcement.snapshot if self.enforcement else [])
                    if self.enforcement is not None
                    else None,
                    utilization=(lambda: self.enforcement.container_util if self.enforcement else {})
                    if self.enforcement is not None
                    else None,
                    backstop=self.backstop.counts if self.backstop is not None else None,
                    allocation=self._node_allocation,
                    host=self._host_cards(),
                )
                self.metrics_server = serve(
                    make_registry(collector), self.cfg.metrics_port, self.cfg.metrics_addr
                )


async def run(cfg: AgentConfig) -> None:
    """The node agent: runs until cancelled.

    Raises :class:`~kvgpu.agent.discovery.DiscoveryError` when no card list can be obtained at
    start, :class:`~kvgpu.agent.shiminstall.ShimInstallError` when the shim cannot be installed,
    ``ValueError`` for a missing node name.
    """
    async with kube_client(cfg.kubeconfig) as api_client:
        agent = Agent(cfg, KubeApi(api_client), api_client)
        try:
            await agent.run()
        finally:
            if agent.metrics_server is not None:
                server = (
                    agent.metrics_server[0]
                    if isinstance(agent.metrics_server, tuple)
                    else agent.metrics_server
                )
                server.shutdown()


async def run_simulated_fleet(
    simulated: str,
    kubeconfig: str | None,
    *,
    nodes: list[str] | None = None,
    interval_s: float = 30.0,
    simulated_health: str | None = None,
) -> None:
    """One simulated agent per node of the simulated config (or of ``nodes``), in this process,
    sharing one API client — for ``make demo`` and fake-node tests. No device plugin, no metrics
    server, no shim installation. Runs until cancelled; raises ``DiscoveryError`` for a bad file.
    """
    from .discovery import load_simulated_config

    names = nodes or [n.name for n in load_simulated_config(simulated)]
    async with kube_client(kubeconfig) as api_client:
        agents = [
            Agent(
                AgentConfig(
                    node=n,
                    simulated=simulated,
                    kubeconfig=kubeconfig,
                    interval_s=interval_s,
                    simulated_health=simulated_health,
                    device_plugin=False,
                    metrics_port=0,
                ),
                KubeApi(api_client),  # one per agent: its own node watch and caches
                api_client,
            )
            for n in names
        ]
        async with asyncio.TaskGroup() as tg:
            for a in agents:
                tg.create_task(a.run(), name=f"agent-{a.cfg.node}")


__all__ = ["Agent", "AgentConfig", "DiscoveryError", "kube_client", "run", "run_simulated_fleet"]
