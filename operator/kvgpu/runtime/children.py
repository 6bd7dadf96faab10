"""The main process's child processes: the admission webhook workers (and, in dev, the webhook
configurations pointing at them), and the watchdog that stops the operator when a child dies."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from kvgpu.runtime.base import RuntimeBase, log


class Children(RuntimeBase):
    """Start the admission workers; watch them and the claim-phase worker."""

    async def start_webhooks(self) -> None:
        """Start the admission worker processes and a watchdog that stops the operator if one
        dies (the pod is then restarted: admission must not silently lose capacity)."""
        from kvgpu.admission.server import start_workers

        if not (self.cfg.webhook_cert and self.cfg.webhook_key):
            raise ValueError("the webhooks need --webhook-cert and --webhook-key")
        listen = self.cfg.webhook_host if self.cfg.dev_webhook_configurations else "0.0.0.0"
        assert self.cfg.webhook_port is not None
        # Started from this (the main) thread on purpose: the kernel's parent-death signal
        # follows the thread that started a child, and executor threads may come and go. The
        # loop waits the second or two the workers take to listen; it serves nothing else yet.
        self._webhook_procs = start_workers(
            max(1, self.cfg.webhook_workers), listen, self.cfg.webhook_port,
            self.cfg.webhook_cert, self.cfg.webhook_key, self.cfg.operator_usernames)
        log.info("admission webhooks serving", port=self.cfg.webhook_port, workers=len(self._webhook_procs))

    def _children(self) -> list[Any]:
        """The child processes started so far (admission workers, the claim-phase worker)."""
        return [*self._webhook_procs, *([self._phase_worker] if self._phase_worker is not None else [])]

    async def _watch_children(self) -> None:
        """Stop the operator when a child process dies (admission worker, claim-phase worker):
        the kubelet restarts it with them, instead of it running on without them."""
        while True:
            await asyncio.sleep(1.0)
            dead = [p for p in self._children() if not p.is_alive()]
            if dead:
                log.error("a child process died: stopping", child=dead[0].name, exitcode=dead[0].exitcode)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    async def apply_dev_webhooks(self) -> None:
        """The webhook configurations pointing at this process, the pod policy
        (:func:`kvgpu.admission.podpolicy.pod_policy`: the CREATE checks after every mutating
        webhook) and the VGPUClaim policy (:func:`kvgpu.admission.config.claim_policy`: only the
        operator writes claims)."""
        from kvgpu.admission.config import claim_policy, webhook_configurations
        from kvgpu.admission.podpolicy import pod_policy

        ca = Path(self.cfg.webhook_ca or "").read_bytes()  # noqa: ASYNC240 (once, at start-up)
        mutating, validating = webhook_configurations(
            url_base=f"https://{self.cfg.webhook_host}:{self.cfg.webhook_port}", service=None, ca_bundle=ca,
            exclude_namespaces=list(self.cfg.exclude_namespaces))
        policy, binding = claim_policy(list(self.cfg.operator_usernames))
        pods_policy, pods_binding = pod_policy(list(self.cfg.exclude_namespaces))
        adm = client.AdmissionregistrationV1Api(self.api)
        vap = (adm.create_validating_admission_policy, adm.replace_validating_admission_policy,
               adm.read_validating_admission_policy)
        vapb = (adm.create_validating_admission_policy_binding, adm.replace_validating_admission_policy_binding,
                adm.read_validating_admission_policy_binding)
        for body, create, replace_, read in (
            # The pod policy first: the one-call mutating webhook relies on it.
            (pods_policy, *vap),
            (pods_binding, *vapb),
            (mutating, adm.create_mutating_webhook_configuration, adm.replace_mutating_webhook_configuration,
             adm.read_mutating_webhook_configuration),
            (validating, adm.create_validating_webhook_configuration,
             adm.replace_validating_webhook_configuration, adm.read_validating_webhook_configuration),
            (policy, *vap),
            (binding, *vapb),
        ):
            name = body["metadata"]["name"]
            try:
                await create(body)
            except ApiException as e:
                if e.status != 409:
                    raise
                old = await read(name)
                body["metadata"]["resourceVersion"] = old.metadata.resource_version
                await replace_(name, body)
