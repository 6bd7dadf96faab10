"""kvgpu.certs.secrets against the real kube-apiserver: the Secrets created, the webhook
configurations' caBundle set, two replicas at once issuing one set (the other adopts), a second
round writing nothing, rotation when the clock nears notAfter (leaves re-issued under the same
CA; a CA near its end replaced while the old one stays trusted), the files the servers read.
The clock is moved through ``reconcile(now=...)``; everything else is real."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest
from kvgpu.certs.issue import Bundle, kvgpu_layout
from kvgpu.certs.secrets import reconcile
from kvgpu.devcluster import Cluster

DAY = dt.timedelta(days=1)
NAMES = ["kvgpu-ca", "kvgpu-extender-ca", "kvgpu-webhook-tls", "kvgpu-extender-tls",
         "kvgpu-scheduler-extender-client"]


def _webhooks(ns: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two webhook configurations named after the test namespace (no object ever matches them:
    their rules name a resource no one creates)."""
    def hook(kind: str) -> dict[str, Any]:
        return {"name": f"{kind}.{ns}.kvgpu.io", "clientConfig": {"service": {"namespace": ns, "name": "kvgpu-webhook",
                                                                             "path": "/x"}},
                "rules": [{"apiGroups": ["kvgpu.io"], "apiVersions": ["v1alpha1"], "operations": ["CREATE"],
                           "resources": ["nothings"]}],
                "sideEffects": "None", "admissionReviewVersions": ["v1"], "failurePolicy": "Ignore"}
    return ({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
             "metadata": {"name": f"{ns}-mutate", "labels": {"kvgpu.io/test": ns}}, "webhooks": [hook("m")]},
            {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
             "metadata": {"name": f"{ns}-validate", "labels": {"kvgpu.io/test": ns}}, "webhooks": [hook("v")]})


@pytest.fixture
def webhooks(cluster: Cluster, namespace: str) -> Any:
    objs = _webhooks(namespace)
    cluster.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}))
    yield f"{namespace}-mutate", f"{namespace}-validate"
    cluster.kubectl("delete", "mutatingwebhookconfiguration,validatingwebhookconfiguration", "-l",
                    f"kvgpu.io/test={namespace}", "--ignore-not-found", check=False)


def _secrets(cluster: Cluster, ns: str) -> dict[str, dict[str, Any]]:
    items = json.loads(cluster.kubectl("get", "secrets", "-n", ns, "-o", "json").stdout)["items"]
    return {s["metadata"]["name"]: s for s in items if s["metadata"]["name"] in NAMES}


def _data(secret: dict[str, Any]) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def _ca_bundles(cluster: Cluster, names: tuple[str, str]) -> list[bytes]:
    out = []
    for kind, name in zip(("mutatingwebhookconfiguration", "validatingwebhookconfiguration"), names, strict=True):
        obj = json.loads(cluster.kubectl("get", kind, name, "-o", "json").stdout)
        out += [base64.b64decode(h["clientConfig"]["caBundle"]) for h in obj["webhooks"]]
    return out


def _round(cluster: Cluster, ns: str, hooks: tuple[str, str], when: dt.datetime, out: Path | None = None,
           replicas: int = 1) -> list[dict[str, Bundle]]:
    layout = kvgpu_layout(ns, "kvgpu-webhook", "kvgpu-operator", "kvgpu-scheduler")

    async def one() -> dict[str, Bundle]:
        async with cluster.api() as api:
            return await reconcile(api, ns, layout, webhook_ca_secret="kvgpu-ca", mutating=[hooks[0]],
                                   validating=[hooks[1]], out_dir=out, now=lambda: when)

    async def many() -> list[dict[str, Bundle]]:
        return list(await asyncio.gather(*[one() for _ in range(replicas)]))

    return asyncio.run(many())


def test_two_replicas_issue_one_set_and_patch_the_ca_bundle(cluster: Cluster, namespace: str, webhooks: Any,
                                                            tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    a, b = _round(cluster, namespace, webhooks, now, replicas=2)
    assert a == b, "both replicas end with the same certificates: one issued, the other adopted"
    stored = _secrets(cluster, namespace)
    assert sorted(stored) == sorted(NAMES)
    for name, s in stored.items():
        assert s["type"] == "kubernetes.io/tls"
        assert _data(s)["tls.crt"] == a[name].cert
        assert s["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvgpu-operator"
    ca = _data(stored["kvgpu-ca"])
    assert _ca_bundles(cluster, webhooks) == [ca["ca.crt"], ca["ca.crt"]]
    assert ca["tls.crt"].strip() in ca["ca.crt"]
    versions = {n: s["metadata"]["resourceVersion"] for n, s in stored.items()}

    # a later round (a replica starting, the sidecar's next tick) adopts: nothing is written
    out = tmp_path / "tls"
    [c] = _round(cluster, namespace, webhooks, now + DAY, out=out)
    assert c == a
    assert {n: s["metadata"]["resourceVersion"] for n, s in _secrets(cluster, namespace).items()} == versions
    for name in ("kvgpu-webhook-tls", "kvgpu-extender-tls", "kvgpu-scheduler-extender-client"):
        assert (out / name / "tls.crt").read_bytes() == a[name].cert
        assert (out / name / "ca.crt").read_bytes() == a[name].ca
        assert (out / name / "tls.key").stat().st_mode & 0o077 == 0
    assert not (out / "kvgpu-ca").exists(), "CA keys never leave their Secrets"


def test_rotation_near_expiry(cluster: Cluster, namespace: str, webhooks: Any, tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    [first] = _round(cluster, namespace, webhooks, now)
    out = tmp_path / "tls"
    # 61 days on, 29 of the leaves' 90 are left: re-issued under the same CA, caBundle unchanged
    [later] = _round(cluster, namespace, webhooks, now + 61 * DAY, out=out)
    stored = _secrets(cluster, namespace)
    for name in ("kvgpu-webhook-tls", "kvgpu-extender-tls", "kvgpu-scheduler-extender-client"):
        assert later[name].cert != first[name].cert
        assert _data(stored[name])["tls.crt"] == later[name].cert == (out / name / "tls.crt").read_bytes()
    for name in ("kvgpu-ca", "kvgpu-extender-ca"):
        assert later[name] == first[name]
    assert _ca_bundles(cluster, webhooks) == [first["kvgpu-ca"].ca] * 2
    # 2,500 days on, the 10-year CAs have less than a third left: replaced; the caBundle trusts
    # the new and (still valid) old CA, so serving certificates of either verify meanwhile
    [renewed] = _round(cluster, namespace, webhooks, now + 2500 * DAY, out=out)
    assert renewed["kvgpu-ca"].cert != first["kvgpu-ca"].cert
    [bundle, _] = _ca_bundles(cluster, webhooks)
    assert renewed["kvgpu-ca"].cert.strip() in bundle and first["kvgpu-ca"].cert.strip() in bundle
    assert (out / "kvgpu-webhook-tls" / "ca.crt").read_bytes() == bundle
