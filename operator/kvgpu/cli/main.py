"""``kvgpu``: run the operator or the node agent, or a local dev cluster.

    kvgpu operator [--leader-elect] ...    the operator (extender, webhook workers, reconcilers)
    kvgpu agent --node NAME [--simulated FILE]
    kvgpu mps-daemons [--root DIR]         own the MPS control daemons of the node's mps cards
    kvgpu certs [--once] ...               issue and rotate the certificates (no cert-manager)
    kvgpu dev up [--run-dir DIR] [--nodes N --cards M]
    kvgpu dev down [--run-dir DIR]
    kvgpu dev status [--run-dir DIR]
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import click

from kvgpu.cli.certs import certs_cmd

DEFAULT_RUN_DIR = Path("run/dev")


@click.group()
@click.version_option(package_name="kvgpu")
def main() -> None:
    """kvgpu: fractional NVIDIA GPUs for Kubernetes."""


main.add_command(certs_cmd)


@main.command("operator")
@click.option("--kubeconfig", type=click.Path(exists=True, dir_okay=False), default=None,
              help="kubeconfig file; default: the in-cluster service account")
@click.option("--extender-address", default="127.0.0.1:8888", show_default=True,
              help="host:port of the scheduler extender (port 0 = any free port); HTTPS with client "
                   "certificates unless --extender-insecure")
@click.option("--extender-cert", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM serving certificate of the extender (re-read when it changes)")
@click.option("--extender-key", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM private key of --extender-cert")
@click.option("--extender-client-ca", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM CA bundle: the extender answers only clients with a certificate it signed")
@click.option("--extender-allowed-clients", "extender_allowed_clients", multiple=True,
              help="client certificate identities (subject CN or DNS/URI SAN) the extender answers; "
                   "repeatable or comma-separated [default: kvgpu-scheduler]")
@click.option("--extender-insecure", is_flag=True,
              help="serve the extender over plain HTTP without client authentication (dev and benchmarks "
                   "only: any client that reaches the port can bind GPU pods)")
@click.option("--metrics-address", default="", show_default=False,
              help="host:port of a plain-HTTP port serving only /healthz, /readyz and /metrics (kubelet "
                   "probes, Prometheus); default: none")
@click.option("--webhook-port", type=click.IntRange(0, 65535), default=None,
              help="serve the admission webhooks on this port (HTTPS)")
@click.option("--webhook-host", default="127.0.0.1", show_default=True,
              help="host name the API server uses to reach the webhooks")
@click.option("--webhook-cert", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM serving certificate of the webhooks (re-read when it changes)")
@click.option("--webhook-key", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM private key of --webhook-cert")
@click.option("--webhook-ca", type=click.Path(exists=True, dir_okay=False), default=None,
              help="CA bundle for the webhook configurations (with --dev-webhooks)")
@click.option("--webhook-workers", type=click.IntRange(1, 64), default=2, show_default=True,
              help="processes serving the admission webhooks (they share --webhook-port)")
@click.option("--bind-events/--no-bind-events", default=False, show_default=True,
              help="post a GPUSlicesBound Event on each GPU pod when it is bound (which cards, how much): one "
                   "more API write per pod; kube-scheduler's Scheduled Event names the node, the pod's claims "
                   "the cards")
@click.option("--node-choice", type=click.Choice(["extender", "scheduler"]), default="extender", show_default=True,
              help="who picks a GPU pod's node: the extender's filter answers the best node by the GPU policy "
                   "(one round trip per pod; kube-scheduler's own scores are skipped unless the pod states "
                   "soft preferences), or kube-scheduler scores every fitting node with prioritize's help")
@click.option("--dev-webhooks", is_flag=True,
              help="create the webhook configurations pointing at https://<webhook-host>:<port>")
@click.option("--operator-username", "operator_usernames", multiple=True,
              help="user names allowed to write kvgpu.io allocation annotations (repeatable)")
@click.option("--exclude-namespace", "exclude_namespaces", multiple=True,
              help="namespaces the webhooks never see (kube-system always)")
@click.option("--leader-elect", is_flag=True,
              help="several replicas: the holder of a Lease serves, the others stand by (warm) and take over")
@click.option("--lease-namespace", default="kvgpu-system", show_default=True, help="namespace of the Lease")
@click.option("--lease-name", default="kvgpu-operator", show_default=True, help="name of the Lease")
@click.option("--identity", envvar="POD_NAME", default="",
              help="this replica's name in the Lease (env POD_NAME; default host name + PID)")
@click.option("--peering/--standalone", default=False, show_default=True,
              help="Kopf peering instead of --leader-elect (Kopf pauses watching only; prefer --leader-elect)")
@click.option("--priority", type=int, default=0, help="peering priority of this replica (distinct per replica)")
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None,
              help="write the extender URL here once the ledger is rebuilt")
def operator_cmd(kubeconfig: str | None, extender_address: str, extender_cert: str | None,
                 extender_key: str | None, extender_client_ca: str | None,
                 extender_allowed_clients: tuple[str, ...], extender_insecure: bool, metrics_address: str,
                 webhook_port: int | None, webhook_host: str,
                 webhook_cert: str | None, webhook_key: str | None, webhook_ca: str | None, webhook_workers: int,
                 bind_events: bool, node_choice: str, dev_webhooks: bool,
                 operator_usernames: tuple[str, ...], exclude_namespaces: tuple[str, ...], leader_elect: bool,
                 lease_namespace: str, lease_name: str, identity: str, peering: bool, priority: int,
                 ready_file: str | None) -> None:
    """Run the operator: scheduler extender, admission webhooks and reconcilers."""
    from kvgpu.extender.choice import NodeChoice
    from kvgpu.extender.tls import parse_allowed
    from kvgpu.logs import configure_logging
    from kvgpu.procs import run_loop
    from kvgpu.runtime import OperatorConfig, run

    host, _, port = extender_address.rpartition(":")
    if not host or not port.isdigit():
        raise click.BadParameter("use host:port", param_hint="--extender-address")
    if not extender_insecure and not (extender_cert and extender_key and extender_client_ca):
        raise click.UsageError("the extender serves mutual TLS: give --extender-cert, --extender-key and "
                               "--extender-client-ca, or --extender-insecure for plain HTTP (dev only)")
    metrics_host, metrics_port = "127.0.0.1", None
    if metrics_address:
        metrics_host, _, mport = metrics_address.rpartition(":")
        if not metrics_host or not mport.isdigit():
            raise click.BadParameter("use host:port", param_hint="--metrics-address")
        metrics_port = int(mport)
    cfg = OperatorConfig(
        kubeconfig=kubeconfig, extender_host=host, extender_port=int(port), extender_cert=extender_cert,
        extender_key=extender_key, extender_client_ca=extender_client_ca,
        extender_allowed_clients=parse_allowed(extender_allowed_clients), extender_insecure=extender_insecure,
        metrics_host=metrics_host, metrics_port=metrics_port, webhook_port=webhook_port,
        webhook_host=webhook_host, webhook_cert=webhook_cert, webhook_key=webhook_key, webhook_ca=webhook_ca,
        webhook_workers=webhook_workers, bind_events=bind_events, node_choice=NodeChoice(node_choice),
        dev_webhook_configurations=dev_webhooks, operator_usernames=operator_usernames,
        exclude_namespaces=exclude_namespaces, standalone=not peering, priority=priority,
        ready_file=ready_file, leader_elect=leader_elect, lease_namespace=lease_namespace, lease_name=lease_name,
        identity=identity)
    configure_logging()
    run_loop(run(cfg))


@main.command("agent")
@click.option("--node", envvar="NODE_NAME", default="", help="this node's name (env NODE_NAME)")
@click.option("--kubeconfig", type=click.Path(exists=True, dir_okay=False), default=None,
              help="kubeconfig file; default: the in-cluster service account")
@click.option("--simulated", type=click.Path(exists=True, dir_okay=False), default=None,
              help="simulated inventory file (no NVML): see kvgpu.core.inventory")
@click.option("--fleet", is_flag=True,
              help="with --simulated: one agent per node of the file, in this process (fake nodes)")
@click.option("--interval", type=float, default=30.0, show_default=True, help="re-discovery period, s")
@click.option("--shim-source", type=click.Path(exists=True, dir_okay=False), default=None,
              help="the built libvgpu.so to install on the host")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=9394, show_default=True,
              help="usage exporter port (0 = off)")
@click.option("--no-device-plugin", is_flag=True, help="do not serve the kubelet device plugin")
@click.option("--device-specs/--no-device-specs", default=True, show_default=True,
              help="Allocate hands the container its /dev/nvidia* nodes and the driver's files; turn off on "
                   "nodes whose NVIDIA container toolkit does it (it reads NVIDIA_VISIBLE_DEVICES)")
@click.option("--dev-root", default="/dev", show_default=True,
              help="where the agent sees the host's /dev/nvidia* nodes")
@click.option("--host-dev-root", default=None,
              help="the path of --dev-root on the host, written into device specs (default: --dev-root)")
@click.option("--driver-root", default="auto", show_default=True,
              help="driver folder with lib64/ and bin/, mounted at /usr/local/nvidia in GPU containers; "
                   "auto = /usr/local/nvidia if it has lib64, none = no driver mounts")
@click.option("--ld-library-path/--no-ld-library-path", default=True, show_default=True,
              help="with driver mounts, set LD_LIBRARY_PATH=/usr/local/nvidia/lib64 in GPU containers")
@click.option("--mounts", type=click.Choice(["dir", "pinned"]), default="dir", show_default=True,
              help="how Allocate mounts the shim in GPU containers (dir: the host shim directory; "
                   "pinned: the version-named file libvgpu.so points at when the container is created)")
@click.option("--visible-devices-from-ids", is_flag=True,
              help="containers without a kvgpu claim get the kubelet's cards instead of being refused "
                   "(clusters without kvgpu's webhook only)")
@click.option("--pod-resources-socket", default="/var/lib/kubelet/pod-resources/kubelet.sock", show_default=True,
              help="the kubelet's PodResources socket (tells which pod the kubelet is admitting)")
@click.option("--dra/--no-dra", default=True, show_default=True,
              help="serve the DRA kubelet plugin gpu.kvgpu.io and publish the node's ResourceSlice "
                   "(cards of allocation: dra pools)")
@click.option("--kubelet-root", default="/var/lib/kubelet", show_default=True,
              help="the kubelet's root: the DRA plugin registers in <root>/plugins_registry and serves "
                   "in <root>/plugins/gpu.kvgpu.io")
@click.option("--cdi-dir", default="/var/run/cdi", show_default=True,
              help="where the container runtime reads CDI specs (containerd's cdi_spec_dirs)")
@click.option("--dra-state-dir", default="/var/lib/kvgpu/dra", show_default=True,
              help="prepared ResourceClaims' claim files, regions and checkpoints")
@click.option("--mps-daemons", type=click.Choice(["agent", "separate"]), default="agent", show_default=True,
              help="who runs the MPS control daemons of mps cards: agent = this process (they end with its "
                   "container); separate = `kvgpu mps-daemons` (the chart's kvgpu-mps DaemonSet), the agent "
                   "only writes which cards are mps")
@click.option("--unenforced", type=click.Choice(["kill", "report"]), default="kill", show_default=True,
              help="a GPU process of a container with slices that runs outside the shim (seen so for "
                   "--unenforced-grace seconds): kill it, or only report it (Event GPUUnenforced, metric)")
@click.option("--unenforced-grace", type=float, default=10.0, show_default=True,
              help="seconds a process must be seen outside the shim, or a container over its limit, "
                   "before --unenforced / --over-limit kill ends it")
@click.option("--over-limit", type=click.Choice(["kill", "report"]), default="kill", show_default=True,
              help="a container with slices whose processes hold more of a card than its limit (NVML) "
                   "plus --over-limit-slack, for --unenforced-grace seconds: kill its largest processes until "
                   "it is under, or only report it (metric kvgpu_container_nvml_memory_bytes)")
@click.option("--over-limit-slack", type=int, default=64, show_default=True,
              help="MiB of NVML use above a container's limit that --over-limit tolerates")
@click.option("--over-cores", type=click.Choice(["kill", "report"]), default="kill", show_default=True,
              help="a container with slices whose processes used more of a card's SMs than its cores "
                   "(NVML) plus --over-cores-slack, on average over --over-cores-grace seconds: kill its "
                   "busiest processes until it is under, or only report it (metric "
                   "kvgpu_container_sm_utilization_percent)")
@click.option("--over-cores-slack", type=click.FloatRange(min=0), default=20.0, show_default=True,
              help="points of SM utilisation above a container's cores that --over-cores tolerates "
                   "(at most half of what is left above the cores)")
@click.option("--over-cores-grace", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="seconds of checks --over-cores averages a container's SM utilisation over")
def agent_cmd(node: str, kubeconfig: str | None, simulated: str | None, fleet: bool, interval: float,
              shim_source: str | None, metrics_port: int, no_device_plugin: bool, device_specs: bool,
              dev_root: str, host_dev_root: str | None, driver_root: str, ld_library_path: bool, mounts: str,
              visible_devices_from_ids: bool, pod_resources_socket: str, dra: bool, kubelet_root: str,
              cdi_dir: str, dra_state_dir: str, mps_daemons: str, unenforced: str,
              unenforced_grace: float, over_limit: str, over_limit_slack: int, over_cores: str,
              over_cores_slack: float, over_cores_grace: float) -> None:
    """Run the node agent: discovery, inventory, health, device plugin, shim install, usage metrics."""
    from kvgpu.agent.config import AgentConfig
    from kvgpu.agent.deviceplugin import PluginConfig
    from kvgpu.agent.devicespecs import resolve_driver_root
    from kvgpu.agent.draplugin import DraConfig
    from kvgpu.agent.main import run, run_simulated_fleet
    from kvgpu.dra.slices import DRIVER
    from kvgpu.logs import configure_logging

    configure_logging()
    if fleet:
        if not simulated:
            raise click.BadParameter("--fleet needs --simulated", param_hint="--fleet")
        asyncio.run(run_simulated_fleet(simulated, kubeconfig, interval_s=interval))
        return
    if not node:
        raise click.BadParameter("give --node or set NODE_NAME", param_hint="--node")
    plugin = PluginConfig(device_specs=device_specs, dev_root=dev_root, host_dev_root=host_dev_root,
                          driver_root=resolve_driver_root(driver_root),
                          ld_library_path=ld_library_path, mounts=mounts,
                          visible_devices_from_ids=visible_devices_from_ids)
    cfg = AgentConfig(node=node, simulated=simulated, kubeconfig=kubeconfig, interval_s=interval,
                      shim_source=shim_source, metrics_port=metrics_port, device_plugin=not no_device_plugin,
                      plugin=plugin, pod_resources_socket=pod_resources_socket, mps_daemons=mps_daemons,
                      unenforced=unenforced, unenforced_grace_s=unenforced_grace,
                      over_limit=over_limit, over_limit_slack_mib=over_limit_slack,
                      over_cores=over_cores, over_cores_slack_pts=over_cores_slack,
                      over_cores_grace_s=over_cores_grace,
                      dra=DraConfig(registry_dir=f"{kubelet_root}/plugins_registry",
                                    plugin_dir=f"{kubelet_root}/plugins/{DRIVER}", cdi_dir=cdi_dir,
                                    state_dir=dra_state_dir) if dra else None)
    asyncio.run(run(cfg))


@main.command("mps-daemons")
@click.option("--root", default="/var/run/kvgpu/mps", show_default=True,
              help="the host folder of the daemons (the agent's wanted.json, status.json, one folder per card)")
@click.option("--control", default="nvidia-cuda-mps-control", show_default=True,
              help="the MPS control program: a path, or a name looked up in <driver root>/bin, then PATH")
@click.option("--driver-root", default="/usr/local/nvidia", show_default=True,
              help="driver folder whose bin/ holds the control program")
@click.option("--interval", type=float, default=5.0, show_default=True,
              help="round period, s: read wanted.json, start dead daemons, quit unwanted ones, write status.json")
def mps_daemons_cmd(root: str, control: str, driver_root: str, interval: float) -> None:
    """Own the MPS control daemons of the node's mps cards, apart from the agent (whose container
    may restart without ending them): the agent writes which cards are mps, this keeps one daemon
    per such card running and reports their liveness for the agent's Allocate."""
    import os
    import signal

    from kvgpu.agent.mps import MpsDaemons, MpsOwner
    from kvgpu.logs import configure_logging

    configure_logging()
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda n, _f: stopping.append(n))
    owner = MpsOwner(MpsDaemons(root, control, driver_root=driver_root), interval_s=interval)
    # As its container's PID 1 it inherits the detached daemons: it reaps the dead ones. The daemons
    # stay when it returns (outside a container a restarted owner reuses them).
    owner.run(stop=lambda: bool(stopping), reap=os.getpid() == 1)


@main.group()
def dev() -> None:
    """A real local control plane (etcd, kube-apiserver, kube-scheduler, KCM) for development."""


@dev.command("up")
@click.option("--run-dir", type=click.Path(path_type=Path), default=DEFAULT_RUN_DIR, show_default=True)
@click.option("--nodes", type=click.IntRange(0, 10000), default=2, show_default=True, help="fake GPU nodes")
@click.option("--cards", type=click.IntRange(1, 16), default=4, show_default=True, help="cards per fake node")
def dev_up(run_dir: Path, nodes: int, cards: int) -> None:
    """Start the control plane in the background and create fake GPU nodes."""
    from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode
    from kvgpu.devcluster import Cluster
    from kvgpu.devcluster.fakenodes import create_nodes

    if (run_dir / "cluster.json").exists() and any(Cluster.attach(run_dir).alive().values()):
        raise click.ClickException(f"a dev cluster already runs in {run_dir}; `kvgpu dev down` first")
    c = Cluster(run_dir=run_dir.resolve(), detached=True).start()
    sims = [SimulatedNode(f"gpu-node-{i}", (SimulatedCardSpec(count=cards),)) for i in range(nodes)]

    async def _nodes() -> None:
        async with c.api() as api:
            await create_nodes(api, sims)

    asyncio.run(_nodes())
    click.echo(f"control plane up: {c.server}")
    click.echo("note: this is the control plane and fake GPU nodes only — kvgpu itself (CRDs, operator, "
               "kvgpu-scheduler) is not running here; `make demo` runs the whole system")
    click.echo(f"export KUBECONFIG={c.kubeconfig}")
    click.echo(f"stop it with: kvgpu dev down --run-dir {run_dir}")


@dev.command("down")
@click.option("--run-dir", type=click.Path(path_type=Path), default=DEFAULT_RUN_DIR, show_default=True)
def dev_down(run_dir: Path) -> None:
    """Stop every process `kvgpu dev up` started (by PID)."""
    from kvgpu.devcluster import Cluster

    if not (run_dir / "cluster.json").exists():
        raise click.ClickException(f"no dev cluster state in {run_dir}")
    c = Cluster.attach(run_dir)
    c.stop()
    click.echo("stopped")


@dev.command("status")
@click.option("--run-dir", type=click.Path(path_type=Path), default=DEFAULT_RUN_DIR, show_default=True)
def dev_status(run_dir: Path) -> None:
    """Show which components of the dev cluster run."""
    from kvgpu.devcluster import Cluster

    if not (run_dir / "cluster.json").exists():
        raise click.ClickException(f"no dev cluster state in {run_dir}")
    c = Cluster.attach(run_dir)
    click.echo(json.dumps({"server": c.server, "kubeconfig": str(c.kubeconfig), "alive": c.alive()}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
