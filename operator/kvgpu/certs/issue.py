"""Certificates as data (pure, no I/O): a CA, serving and client certificates it signs, and
when to renew them. The clock is an argument (``now``, an aware UTC datetime) so tests can
move it.

A :class:`Bundle` is what one Secret holds, PEM bytes under the ``kubernetes.io/tls`` keys:
``tls.crt``, ``tls.key`` and (leaf certificates) ``ca.crt``. Keys are ECDSA P-256.

Renewal (:func:`needs_renewal`): a certificate is renewed when less than a third of its lifetime
is left (``notAfter - now < (notAfter - notBefore) / 3``), when it does not parse, when its key
does not match it, when a leaf is not signed by the current CA or lacks a name it must carry.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_LIFETIME = dt.timedelta(days=3650)
LEAF_LIFETIME = dt.timedelta(days=90)
BACKDATE = dt.timedelta(minutes=5)  # clock skew between the issuer and the verifiers

TLS_CRT, TLS_KEY, CA_CRT = "tls.crt", "tls.key", "ca.crt"


@dataclass(frozen=True)
class Bundle:
    """One Secret's worth: ``cert`` and ``key`` (PEM), ``ca`` (PEM of the signing CA; empty for a CA)."""

    cert: bytes
    key: bytes
    ca: bytes = b""

    def data(self) -> dict[str, bytes]:
        """The Secret's keys (``tls.crt``, ``tls.key``, and ``ca.crt`` when there is one)."""
        out = {TLS_CRT: self.cert, TLS_KEY: self.key}
        if self.ca:
            out[CA_CRT] = self.ca
        return out

    @classmethod
    def from_data(cls, data: dict[str, bytes]) -> Bundle | None:
        """The bundle in a Secret's (decoded) data, or ``None`` when ``tls.crt``/``tls.key`` are missing."""
        if not data.get(TLS_CRT) or not data.get(TLS_KEY):
            return None
        return cls(data[TLS_CRT], data[TLS_KEY], data.get(CA_CRT, b""))


@dataclass(frozen=True)
class LeafSpec:
    """A leaf certificate to issue: subject ``common_name``, DNS SANs ``dns_names``, IP SANs
    ``ip_addresses`` (text form), and whether it authenticates a server (``server=True``:
    serverAuth) or a client (clientAuth)."""

    common_name: str
    dns_names: tuple[str, ...] = ()
    server: bool = True
    ip_addresses: tuple[str, ...] = ()


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(common_name: str, now: dt.datetime, lifetime: dt.timedelta = CA_LIFETIME) -> Bundle:
    """A self-signed CA (``basicConstraints CA:TRUE, pathlen 0``, keyCertSign) valid from
    ``now - BACKDATE`` for ``lifetime``."""
    key = _key()
    cert = (
        x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE).not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Bundle(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def issue(ca: Bundle, spec: LeafSpec, now: dt.datetime, lifetime: dt.timedelta = LEAF_LIFETIME,
          ca_bundle: bytes | None = None) -> Bundle:
    """A leaf certificate for ``spec`` signed by ``ca``, valid for ``lifetime`` (never past the
    CA's own ``notAfter``). Its ``ca.crt`` is ``ca_bundle`` (default: the CA's certificate).

    Raises ``ValueError`` when ``ca`` is not a CA bundle (no parsable certificate/key)."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the CA key must be an ECDSA key")
    key = _key()
    usage = ExtendedKeyUsageOID.SERVER_AUTH if spec.server else ExtendedKeyUsageOID.CLIENT_AUTH
    b = (
        x509.CertificateBuilder().subject_name(_name(spec.common_name)).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE).not_valid_after(min(now + lifetime, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in spec.dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in spec.ip_addresses]
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = b.sign(ca_key, hashes.SHA256())
    return Bundle(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key),
                  ca.cert if ca_bundle is None else ca_bundle)


def _due(cert: x509.Certificate, now: dt.datetime) -> bool:
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    return cert.not_valid_after_utc - now < life / 3


def _key_matches(cert: x509.Certificate, key_pem: bytes) -> bool:
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        return False
    pub = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return bool(key.public_key().public_bytes(*pub) == cert.public_key().public_bytes(*pub))


def needs_renewal(bundle: Bundle | None, now: dt.datetime, ca: Bundle | None = None,
                  spec: LeafSpec | None = None) -> bool:
    """Whether ``bundle`` must be (re-)issued at ``now``: missing, unparsable, key mismatch, less
    than a third of its lifetime left; for a leaf (``ca`` given) also not signed by ``ca`` or a
    ``ca.crt`` that does not carry ``ca``'s certificate; with ``spec``, a subject or DNS names
    other than the spec's."""
    if bundle is None:
        return True
    try:
        cert = x509.load_pem_x509_certificate(bundle.cert)
    except ValueError:
        return True
    if not _key_matches(cert, bundle.key) or _due(cert, now):
        return True
    if ca is not None:
        ca_cert = x509.load_pem_x509_certificate(ca.cert)
        try:
            cert.verify_directly_issued_by(ca_cert)
        except (ValueError, TypeError, InvalidSignature):
            return True
        if ca.cert.strip() not in bundle.ca:
            return True
    if spec is not None:
        cns = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
        try:
            ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            sans, ips = ext.get_values_for_type(x509.DNSName), [str(a) for a in ext.get_values_for_type(x509.IPAddress)]
        except x509.ExtensionNotFound:
            sans, ips = [], []
        want_ips = sorted(str(ipaddress.ip_address(a)) for a in spec.ip_addresses)
        if cns != [spec.common_name] or sorted(sans) != sorted(spec.dns_names) or sorted(ips) != want_ips:
            return True
    return False


def not_after(pem: bytes) -> dt.datetime:
    """The ``notAfter`` (aware UTC) of the first certificate in ``pem``. Raises ``ValueError``
    when ``pem`` holds no certificate."""
    return x509.load_pem_x509_certificate(pem).not_valid_after_utc


def trust_bundle(current: bytes, previous: bytes, now: dt.datetime) -> bytes:
    """The CA certificates verifiers should trust: ``current``, then those of ``previous`` (an
    older bundle) that are still valid at ``now`` and differ from ``current`` — so certificates
    signed by a CA being replaced keep verifying until they are re-issued."""
    out = [current.strip()]
    for cert in x509.load_pem_x509_certificates(previous) if previous.strip() else []:
        pem = cert.public_bytes(serialization.Encoding.PEM).strip()
        if pem not in out and cert.not_valid_after_utc > now:
            out.append(pem)
    return b"\n".join(out) + b"\n"


@dataclass(frozen=True)
class Layout:
    """Which Secrets hold what: ``cas`` maps a CA Secret's name to its subject CN; ``leaves`` maps
    a leaf Secret's name to (the name of its CA Secret, what to issue). CAs are written first."""

    cas: dict[str, str]
    leaves: dict[str, tuple[str, LeafSpec]]


def plan(layout: Layout, current: dict[str, Bundle | None], now: dt.datetime) -> dict[str, Bundle]:
    """The Secrets to (re)write at ``now`` given ``current`` (Secret name -> bundle, ``None`` =
    missing or unusable): every CA that :func:`needs_renewal`, every leaf that needs renewal or
    whose CA is renewed. A CA Secret's ``ca.crt`` is its trust bundle (:func:`trust_bundle`:
    the new CA plus the replaced one while it is valid); leaves carry their CA's trust bundle.
    An empty result means everything is current: adopt it as it is. Order: CAs, then leaves."""
    out: dict[str, Bundle] = {}
    cas: dict[str, Bundle] = {}
    for name, cn in layout.cas.items():
        old = current.get(name)
        if needs_renewal(old, now):
            fresh = make_ca(cn, now)
            prev = (old.ca or old.cert) if old is not None else b""
            try:
                trust = trust_bundle(fresh.cert, prev, now)
            except ValueError:  # an unparsable old bundle: trust only the new CA
                trust = trust_bundle(fresh.cert, b"", now)
            out[name] = cas[name] = Bundle(fresh.cert, fresh.key, trust)
        else:
            assert old is not None
            cas[name] = old if old.ca else Bundle(old.cert, old.key, old.cert)
    for name, (ca_name, spec) in layout.leaves.items():
        ca = cas[ca_name]
        if ca_name in out or needs_renewal(current.get(name), now, Bundle(ca.cert, ca.key, ca.ca), spec):
            out[name] = issue(ca, spec, now, ca_bundle=ca.ca)
    return out


def split_names(names: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``names`` as (DNS names, IP addresses), each without duplicates, in order. Raises
    ``ValueError`` naming an entry that is neither (empty, or with a scheme, port or path)."""
    dns: list[str] = []
    ips: list[str] = []
    for n in names:
        try:
            ip = str(ipaddress.ip_address(n))
        except ValueError:
            if not n or any(c in n for c in ":/ ") or n.startswith(".") or n.endswith("."):
                raise ValueError(f"{n!r} is neither a DNS name nor an IP address") from None
            if n not in dns:
                dns.append(n)
            continue
        if ip not in ips:
            ips.append(ip)
    return tuple(dns), tuple(ips)


def kvgpu_layout(namespace: str, webhook_service: str, extender_service: str,
                 scheduler_client: str, webhook_sans: Iterable[str] = (),
                 extender_sans: Iterable[str] = ()) -> Layout:
    """kvgpu's Secrets (the names the chart mounts or reads): the webhook CA ``kvgpu-ca`` signs
    ``kvgpu-webhook-tls`` (``<webhook_service>.<namespace>.svc`` and ``.svc.cluster.local``);
    the extender CA ``kvgpu-extender-ca`` — a CA of its own, so no webhook certificate is an
    extender client — signs ``kvgpu-extender-tls`` (``<extender_service>...``) and the
    kube-scheduler's client certificate ``kvgpu-scheduler-extender-client`` (CN
    ``scheduler_client``, the operator's ``--extender-allowed-clients``). ``webhook_sans`` and
    ``extender_sans``: further names (DNS or IP) of the two serving certificates, for a webhook
    URL or extender URL that does not go through the Service (:func:`split_names`)."""
    def sans(svc: str, extra: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return split_names([f"{svc}.{namespace}.svc", f"{svc}.{namespace}.svc.cluster.local", *extra])

    wh_dns, wh_ips = sans(webhook_service, webhook_sans)
    ex_dns, ex_ips = sans(extender_service, extender_sans)
    return Layout(
        cas={"kvgpu-ca": "kvgpu-webhook-ca", "kvgpu-extender-ca": "kvgpu-extender-ca"},
        leaves={
            "kvgpu-webhook-tls": ("kvgpu-ca", LeafSpec(f"{webhook_service}.{namespace}.svc", wh_dns,
                                                        ip_addresses=wh_ips)),
            "kvgpu-extender-tls": ("kvgpu-extender-ca", LeafSpec("kvgpu-extender", ex_dns, ip_addresses=ex_ips)),
            "kvgpu-scheduler-extender-client": ("kvgpu-extender-ca", LeafSpec(scheduler_client, (), server=False)),
        },
    )
