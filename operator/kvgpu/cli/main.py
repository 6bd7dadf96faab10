"""``kvgpu``: run the operator or the node agent, or a local dev cluster.

    kvgpu operator [--dev]                 the operator (extender, webhooks, reconcilers)
    kvgpu agent --node NAME [--simulated FILE]
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

DEFAULT_RUN_DIR = Path("run/dev")


@click.group()
@click.version_option(package_name="kvgpu")
def main() -> None:
    """kvgpu: fractional NVIDIA GPUs for Kubernetes."""


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
    c = Cluster(run_dir=run_dir.resolve()).start()
    sims = [SimulatedNode(f"gpu-node-{i}", (SimulatedCardSpec(count=cards),)) for i in range(nodes)]

    async def _nodes() -> None:
        async with c.api() as api:
            await create_nodes(api, sims)

    asyncio.run(_nodes())
    click.echo(f"control plane up: {c.server}")
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

    c = Cluster.attach(run_dir)
    click.echo(json.dumps({"server": c.server, "kubeconfig": str(c.kubeconfig), "alive": c.alive()}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
