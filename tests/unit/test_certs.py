"""kvgpu.certs.issue without I/O: the CA and leaf certificates as verifiers see them, when they
are renewed (the clock is an argument), and the plan of Secrets to write."""

from __future__ import annotations

import datetime as dt
import ssl

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from kvgpu.certs.issue import (
    Bundle,
    LeafSpec,
    issue,
    kvgpu_layout,
    make_ca,
    needs_renewal,
    not_after,
    plan,
    split_names,
    trust_bundle,
)

NOW = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
DAY = dt.timedelta(days=1)
LAYOUT = kvgpu_layout("kvgpu-system", "kvgpu-webhook", "kvgpu-operator", "kvgpu-scheduler")


def _cert(b: Bundle) -> x509.Certificate:
    return x509.load_pem_x509_certificate(b.cert)


def test_leaf_verifies_against_its_ca_with_the_service_names(tmp_path: object) -> None:
    ca = make_ca("test-ca", NOW)
    leaf = issue(ca, LeafSpec("kvgpu-webhook.ns.svc", ("kvgpu-webhook.ns.svc", "kvgpu-webhook.ns.svc.cluster.local")),
                 NOW)
    cert = _cert(leaf)
    cert.verify_directly_issued_by(_cert(ca))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert sans == ["kvgpu-webhook.ns.svc", "kvgpu-webhook.ns.svc.cluster.local"]
    assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == \
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH])
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert _cert(ca).extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert leaf.ca == ca.cert
    assert not_after(leaf.cert) == NOW + dt.timedelta(days=90)
    # OpenSSL (what the servers use) loads the pair
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    import pathlib
    d = pathlib.Path(str(tmp_path))
    (d / "c").write_bytes(leaf.cert)
    (d / "k").write_bytes(leaf.key)
    ctx.load_cert_chain(d / "c", d / "k")


def test_client_certificate_is_client_auth_only() -> None:
    ca = make_ca("ca", NOW)
    cert = _cert(issue(ca, LeafSpec("kvgpu-scheduler", (), server=False), NOW))
    assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == \
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])
    with pytest.raises(x509.ExtensionNotFound):
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)


def test_leaf_never_outlives_its_ca() -> None:
    ca = make_ca("ca", NOW, lifetime=10 * DAY)
    assert not_after(issue(ca, LeafSpec("x", ("x",)), NOW).cert) == not_after(ca.cert)


@pytest.mark.parametrize(("days", "due"), [(0, False), (59, False), (61, True), (95, True)])
def test_renewal_once_a_third_of_the_lifetime_is_left(days: int, due: bool) -> None:
    """90-day leaves (backdated 5 min): due when less than 30 days are left."""
    ca = make_ca("ca", NOW)
    spec = LeafSpec("x", ("x",))
    leaf = issue(ca, spec, NOW)
    assert needs_renewal(leaf, NOW + days * DAY, ca, spec) is due


def test_renewal_when_the_leaf_no_longer_matches() -> None:
    ca, other = make_ca("ca", NOW), make_ca("other", NOW)
    spec = LeafSpec("a.ns.svc", ("a.ns.svc",))
    leaf = issue(ca, spec, NOW)
    assert not needs_renewal(leaf, NOW, ca, spec)
    assert needs_renewal(None, NOW)
    assert needs_renewal(leaf, NOW, other, spec), "signed by another CA"
    assert needs_renewal(leaf, NOW, ca, LeafSpec("a.other.svc", ("a.other.svc",))), "names changed"
    assert needs_renewal(Bundle(leaf.cert, other.key, leaf.ca), NOW), "key does not match"
    assert needs_renewal(Bundle(b"garbage", leaf.key), NOW), "unparsable"


def test_plan_issues_everything_then_nothing() -> None:
    first = plan(LAYOUT, {}, NOW)
    assert list(first) == ["kvgpu-ca", "kvgpu-extender-ca", "kvgpu-webhook-tls", "kvgpu-extender-tls",
                           "kvgpu-scheduler-extender-client"]
    assert plan(LAYOUT, dict(first), NOW) == {}, "current Secrets are adopted as they are"
    assert plan(LAYOUT, dict(first), NOW + 59 * DAY) == {}
    # the extender pair and the client certificate share the extender CA, not the webhook CA
    ext_ca = _cert(first["kvgpu-extender-ca"])
    for name in ("kvgpu-extender-tls", "kvgpu-scheduler-extender-client"):
        _cert(first[name]).verify_directly_issued_by(ext_ca)
    assert first["kvgpu-webhook-tls"].ca == first["kvgpu-ca"].ca
    assert first["kvgpu-ca"].cert != first["kvgpu-extender-ca"].cert


def test_plan_rotates_leaves_and_keeps_the_ca() -> None:
    first = plan(LAYOUT, {}, NOW)
    later = plan(LAYOUT, dict(first), NOW + 61 * DAY)
    assert set(later) == {"kvgpu-webhook-tls", "kvgpu-extender-tls", "kvgpu-scheduler-extender-client"}
    for name, b in later.items():
        assert b.cert != first[name].cert and b.ca == first[name].ca


def test_ca_renewal_keeps_trusting_the_old_ca_while_it_is_valid() -> None:
    first = plan(LAYOUT, {}, NOW)
    when = NOW + 2500 * DAY  # a 10-year CA with less than a third left
    renewed = plan(LAYOUT, dict(first), when)
    assert {"kvgpu-ca", "kvgpu-webhook-tls"} <= set(renewed)
    trust = renewed["kvgpu-ca"].ca
    assert renewed["kvgpu-ca"].cert.strip() in trust and first["kvgpu-ca"].cert.strip() in trust
    assert renewed["kvgpu-webhook-tls"].ca == trust
    _cert(renewed["kvgpu-webhook-tls"]).verify_directly_issued_by(_cert(renewed["kvgpu-ca"]))
    # once the old CA has expired it leaves the bundle
    assert trust_bundle(renewed["kvgpu-ca"].cert, trust, NOW + 3700 * DAY).count(b"BEGIN CERTIFICATE") == 1


def test_extra_names_for_urls_that_bypass_the_service() -> None:
    """A webhook URL or extender URL on a node address (hostNetwork): its host joins the serving
    certificate, as a DNS or an IP SAN; a changed list re-issues the certificate."""
    layout = kvgpu_layout("ns", "kvgpu-webhook", "kvgpu-operator", "kvgpu-scheduler",
                          webhook_sans=["10.0.0.5", "gpu-node-1.example"], extender_sans=["127.0.0.1", "::1"])
    first = plan(layout, {}, NOW)
    ext = _cert(first["kvgpu-extender-tls"]).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in ext.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
    wh = _cert(first["kvgpu-webhook-tls"]).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert wh.get_values_for_type(x509.DNSName) == ["kvgpu-webhook.ns.svc", "kvgpu-webhook.ns.svc.cluster.local",
                                                    "gpu-node-1.example"]
    assert [str(a) for a in wh.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    assert plan(layout, dict(first), NOW) == {}
    fewer = kvgpu_layout("ns", "kvgpu-webhook", "kvgpu-operator", "kvgpu-scheduler", extender_sans=["127.0.0.1"])
    assert set(plan(fewer, dict(first), NOW)) == {"kvgpu-webhook-tls", "kvgpu-extender-tls"}


@pytest.mark.parametrize("bad", ["https://10.0.0.5", "host:8443", "", "a/b"])
def test_a_san_that_is_no_name_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="neither a DNS name nor an IP address"):
        split_names([bad])
