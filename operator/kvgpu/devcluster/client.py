"""kubernetes_asyncio clients for a kubeconfig file."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from kubernetes_asyncio import client, config


@asynccontextmanager
async def api_client(kubeconfig: Path | str) -> AsyncIterator[client.ApiClient]:
    """Yield an ``ApiClient`` configured from ``kubeconfig``; closed on exit."""
    cfg = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    async with client.ApiClient(configuration=cfg) as api:
        yield api
