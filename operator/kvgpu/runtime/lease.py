"""Leader election on a Lease (``--leader-elect``): a standby rebuilds the ledger and serves
when it wins, and stops when it loses the Lease."""

from __future__ import annotations

import asyncio
import os
import signal

from kvgpu.runtime.base import RuntimeBase, log


class Lease(RuntimeBase):
    """Run for the Lease; on winning, :meth:`rebuild` and :meth:`_became_ready` (both
    :class:`kvgpu.runtime.Runtime`'s)."""

    async def rebuild(self) -> None:
        raise NotImplementedError  # kvgpu.runtime.main.Runtime.rebuild

    def _became_ready(self) -> None:
        raise NotImplementedError  # kvgpu.runtime.main.Runtime._became_ready

    async def _elect(self) -> None:
        """Run for the Lease (kubernetes_asyncio.leaderelection). On winning: rebuild the ledger
        from the claims, then serve. On losing it: stop the process (a fresh start is the only
        safe way back to standby; the kubelet restarts it)."""
        import socket

        from kubernetes_asyncio.leaderelection import electionconfig, leaderelection
        from kubernetes_asyncio.leaderelection.resourcelock.leaselock import LeaseLock

        identity = self.cfg.identity or f"{socket.gethostname()}-{os.getpid()}"
        lock = LeaseLock(self.cfg.lease_name, self.cfg.lease_namespace, identity, self.api)
        d = int(self.cfg.lease_duration_s)  # the lock stores it as an integer string
        cfg = electionconfig.Config(lock, lease_duration=d, renew_deadline=d * 2 / 3, retry_period=d / 7,
                                    onstarted_leading=self._lead, onstopped_leading=self._lost)
        try:
            await leaderelection.LeaderElection(cfg).run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("leader election failed: stopping")
            os.kill(os.getpid(), signal.SIGTERM)

    async def _lead(self) -> None:
        log.info("won the lease: rebuilding the ledger", identity=self.cfg.identity or os.getpid())
        await self.rebuild()
        self.active = True
        self.pools_dirty = True
        self._became_ready()
        await asyncio.Event().wait()  # lead until cancelled (lease lost)

    async def _lost(self) -> None:
        was = self.active
        self.active = False
        self.state.mark_not_ready()
        if was:
            log.error("lost the lease: stopping so a fresh process can stand by")
            os.kill(os.getpid(), signal.SIGTERM)
