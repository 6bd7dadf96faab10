"""Keep kvgpu's certificates in Secrets and hand them to the servers (the adapter around the
pure :mod:`kvgpu.certs.issue`). Run as ``kvgpu certs`` in the operator pod: once as an init
container (the files exist before the operator starts), then as a sidecar that rotates.

:func:`reconcile` reads the Secrets of a :class:`~kvgpu.certs.issue.Layout`, asks
:func:`~kvgpu.certs.issue.plan` what to (re)write, and writes it with optimistic concurrency:
create when missing, replace with the ``resourceVersion`` it read. Several replicas may run it at
once: the loser of a create (409 AlreadyExists) or replace (409 Conflict) reads again and adopts
what the winner wrote instead of issuing its own (no fight). Then it sets the ``caBundle`` of
every webhook of the named Mutating/ValidatingWebhookConfigurations (read, then replace with the
``resourceVersion``; skipped when already equal) and, with ``out_dir``, writes
``<out_dir>/<secret>/{tls.crt,tls.key,ca.crt}`` atomically for the leaf Secrets — the operator's
``--webhook-cert``/``--extender-cert`` files, which its servers re-read when they change.

Errors: ``ApiException`` other than 404 on read or 409 on write propagates; ``RuntimeError``
after ``attempts`` conflicts in a row.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import structlog
from kubernetes_asyncio import client
from kubernetes_asyncio.client.rest import ApiException

from kvgpu.certs.issue import Bundle, Layout, plan

log = structlog.get_logger("kvgpu.certs")

LABELS = {"app.kubernetes.io/part-of": "kvgpu", "app.kubernetes.io/managed-by": "kvgpu-operator"}


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class _Conflict(Exception):
    """Another writer changed a Secret between our read and our write."""


async def _read(core: client.CoreV1Api, namespace: str, name: str) -> tuple[Bundle | None, str | None]:
    """(bundle, resourceVersion); (None, None) when the Secret is missing."""
    try:
        s = await core.read_namespaced_secret(name, namespace)
    except ApiException as e:
        if e.status == 404:
            return None, None
        raise
    data = {k: base64.b64decode(v) for k, v in (s.data or {}).items()}
    return Bundle.from_data(data), s.metadata.resource_version


def _body(name: str, namespace: str, bundle: Bundle, rv: str | None) -> client.V1Secret:
    return client.V1Secret(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace, labels=dict(LABELS), resource_version=rv),
        type="kubernetes.io/tls",
        data={k: base64.b64encode(v).decode() for k, v in bundle.data().items()})


async def _write(core: client.CoreV1Api, namespace: str, name: str, bundle: Bundle, rv: str | None) -> None:
    try:
        if rv is None:
            await core.create_namespaced_secret(namespace, _body(name, namespace, bundle, None))
        else:
            await core.replace_namespaced_secret(name, namespace, _body(name, namespace, bundle, rv))
    except ApiException as e:
        if e.status == 409:
            raise _Conflict(name) from e
        raise


async def ensure_secrets(api: client.ApiClient, namespace: str, layout: Layout,
                         now: Callable[[], dt.datetime] = _utcnow, attempts: int = 5) -> dict[str, Bundle]:
    """Every Secret of ``layout`` current in ``namespace``; returns name -> bundle as stored."""
    core = client.CoreV1Api(api)
    names = [*layout.cas, *layout.leaves]
    for _ in range(attempts):
        read = {n: await _read(core, namespace, n) for n in names}
        todo = plan(layout, {n: b for n, (b, _) in read.items()}, now())
        try:
            for name, bundle in todo.items():
                bundle_rv = read[name][1]
                await _write(core, namespace, name, bundle, bundle_rv)
                log.info("certificate issued", secret=f"{namespace}/{name}", renewed=bundle_rv is not None)
        except _Conflict as c:
            log.info("certificate written by another replica; adopting it", secret=f"{namespace}/{c}")
            continue
        out = {n: b for n, (b, _) in read.items() if b is not None}
        out.update(todo)
        return out
    raise RuntimeError(f"Secrets in {namespace} kept changing under {attempts} attempts; another writer?")


async def patch_ca_bundles(api: client.ApiClient, ca_bundle: bytes, mutating: Iterable[str],
                           validating: Iterable[str], attempts: int = 5) -> int:
    """Set ``clientConfig.caBundle`` of every webhook of the named configurations to
    ``ca_bundle`` (PEM). Returns how many configurations were changed. A configuration that does
    not exist (yet) is skipped with a warning: the next round sets it."""
    adm = client.AdmissionregistrationV1Api(api)
    want = base64.b64encode(ca_bundle).decode()
    kinds = [(n, adm.read_mutating_webhook_configuration, adm.replace_mutating_webhook_configuration)
             for n in mutating]
    kinds += [(n, adm.read_validating_webhook_configuration, adm.replace_validating_webhook_configuration)
              for n in validating]
    changed = 0
    for name, read, replace in kinds:
        for _ in range(attempts):
            try:
                obj = await read(name)
            except ApiException as e:
                if e.status != 404:
                    raise
                log.warning("webhook configuration not found; caBundle not set", name=name)
                break
            hooks = obj.webhooks or []
            if all(h.client_config.ca_bundle == want for h in hooks):
                break
            for h in hooks:
                h.client_config.ca_bundle = want
            try:
                await replace(name, obj)
            except ApiException as e:
                if e.status == 409:
                    continue
                raise
            changed += 1
            log.info("webhook caBundle set", name=name, webhooks=len(hooks))
            break
    return changed


def write_files(out_dir: Path, bundles: dict[str, Bundle], names: Iterable[str]) -> int:
    """Write ``out_dir/<name>/{tls.crt,tls.key,ca.crt}`` for each of ``names`` whose content
    differs (temp file + rename, keys mode 0600). Returns how many files changed."""
    changed = 0
    for name in names:
        d = out_dir / name
        d.mkdir(parents=True, exist_ok=True)
        for key, value in bundles[name].data().items():
            path = d / key
            if path.exists() and path.read_bytes() == value:
                continue
            tmp = d / f".{key}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            tmp.replace(path)
            changed += 1
    return changed


async def reconcile(api: client.ApiClient, namespace: str, layout: Layout, *, webhook_ca_secret: str,
                    mutating: Iterable[str] = (), validating: Iterable[str] = (), out_dir: Path | None = None,
                    now: Callable[[], dt.datetime] = _utcnow) -> dict[str, Bundle]:
    """One round: :func:`ensure_secrets`, :func:`patch_ca_bundles` with the trust bundle of
    ``webhook_ca_secret``, and :func:`write_files` of the leaves into ``out_dir``."""
    bundles = await ensure_secrets(api, namespace, layout, now)
    ca = bundles[webhook_ca_secret]
    await patch_ca_bundles(api, ca.ca or ca.cert, mutating, validating)
    if out_dir is not None:
        write_files(out_dir, bundles, layout.leaves)
    return bundles


async def run(api: client.ApiClient, namespace: str, layout: Layout, *, interval: float, once: bool,
              **kw: object) -> None:
    """:func:`reconcile` now and (unless ``once``) every ``interval`` seconds; a failed round is
    logged and retried after ``min(interval, 30)`` s. With ``once`` a failure propagates."""
    while True:
        try:
            await reconcile(api, namespace, layout, **kw)  # type: ignore[arg-type]
        except Exception:
            if once:
                raise
            log.exception("certificate round failed; retrying")
            await asyncio.sleep(min(interval, 30.0))
            continue
        if once:
            return
        await asyncio.sleep(interval)
