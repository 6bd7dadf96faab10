"""Throw-away PKI for the local control plane, made with ``cryptography``.

Writes into a directory: ``ca.crt/key`` (cluster CA), ``serving.crt/key`` (kube-apiserver,
SANs for localhost/127.0.0.1 and the in-cluster names), ``admin.crt/key`` (client cert,
``O=system:masters``), ``kvgpu-operator.crt/key`` (the operator, also system:masters),
``scheduler.crt/key`` (``system:kube-scheduler``), ``webhook.crt/key`` (the operator's webhook
server), ``sa.key/sa.pub`` (service-account token signing, RSA 2048). EC P-256 keys, 7-day validity.

The scheduler extender's mutual TLS (issue 14) has its own CA, so no certificate of the cluster
CA (admin, nodes, the operator) is a valid extender client: ``extender-ca.crt/key``,
``extender.crt/key`` (the operator's extender serving certificate: localhost, 127.0.0.1 and
the manifests' ``kvgpu-operator.kvgpu-system.svc``) and ``extender-client.crt/key`` (the kvgpu
kube-scheduler's client certificate, ``CN=kvgpu-scheduler``). :func:`issue_leaf` signs more
(tests: a client the extender must refuse).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID = datetime.timedelta(days=7)


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(
    subject: x509.Name,
    issuer: x509.Name,
    pub: ec.EllipticCurvePublicKey,
    signer: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    san: list[x509.GeneralName] | None = None,
    eku: list[x509.ObjectIdentifier] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(pub)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALID)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_encipherment=False,
                key_cert_sign=ca,
                crl_sign=ca,
                content_commitment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if eku:
        b = b.add_extension(x509.ExtendedKeyUsage(eku), critical=False)
    return b.sign(signer, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    dir: Path

    def path(self, name: str) -> Path:
        return self.dir / name

    def read(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()


def _load_ca(d: Path, stem: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate((d / f"{stem}.crt").read_bytes())
    key = serialization.load_pem_private_key((d / f"{stem}.key").read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return cert, key


def make_ca(d: Path, stem: str, cn: str) -> None:
    """A self-signed CA: ``<stem>.crt`` and ``<stem>.key`` in ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _cert(_name(cn), _name(cn), key.public_key(), key, ca=True)
    (d / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / f"{stem}.key").write_bytes(_pem_key(key))


def issue_leaf(d: Path, stem: str, ca_stem: str, cn: str, *, org: str | None = None, server: bool = False,
               dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()) -> None:
    """``<stem>.crt/key`` signed by the CA ``<ca_stem>.crt/key`` in ``d``: a server (serverAuth,
    SANs ``dns`` and ``ips``) or client (clientAuth) certificate with subject ``CN=cn``."""
    ca, ca_key = _load_ca(d, ca_stem)
    key = ec.generate_private_key(ec.SECP256R1())
    san: list[x509.GeneralName] = [x509.DNSName(n) for n in dns]
    san += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    eku = [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = _cert(_name(cn, org), ca.subject, key.public_key(), ca_key, san=san or None, eku=eku)
    (d / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / f"{stem}.key").write_bytes(_pem_key(key))


EXTENDER_DNS = ("localhost", "kvgpu-operator.kvgpu-system.svc", "kvgpu-operator.kvgpu-system.svc.cluster.local")
EXTENDER_CLIENT_CN = "kvgpu-scheduler"  # kvgpu.extender.tls.DEFAULT_ALLOWED_CLIENTS


def make_extender_pki(d: Path) -> None:
    """The extender's CA, serving certificate and kube-scheduler's client certificate."""
    make_ca(d, "extender-ca", "kvgpu-extender-dev-ca")
    issue_leaf(d, "extender", "extender-ca", "kvgpu-extender", server=True, dns=EXTENDER_DNS, ips=("127.0.0.1",))
    issue_leaf(d, "extender-client", "extender-ca", EXTENDER_CLIENT_CN)


def make_pki(d: Path, extra_sans: tuple[str, ...] = ()) -> Pki:
    """Create the CA and leaf certificates in ``d`` (created if missing). Returns a :class:`Pki`."""
    d.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("kvgpu-dev-ca")
    ca = _cert(ca_name, ca_name, ca_key.public_key(), ca_key, ca=True)
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "ca.key").write_bytes(_pem_key(ca_key))

    def leaf(stem: str, subject: x509.Name, *, server: bool, san: list[x509.GeneralName] | None) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        eku = [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
        cert = _cert(subject, ca_name, key.public_key(), ca_key, san=san, eku=eku)
        (d / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{stem}.key").write_bytes(_pem_key(key))

    dns = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
           "kubernetes.default.svc.cluster.local", *extra_sans]
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", "10.0.0.1")]
    leaf("serving", _name("kube-apiserver"), server=True, san=sans)
    leaf("webhook", _name("kvgpu-webhook"), server=True, san=sans)
    leaf("admin", _name("admin", "system:masters"), server=False, san=None)
    # The operator's own identity, so the validating webhook can tell it from a user.
    leaf("kvgpu-operator", _name("kvgpu-operator", "system:masters"), server=False, san=None)
    leaf("scheduler", _name("system:kube-scheduler"), server=False, san=None)
    leaf("controller-manager", _name("system:kube-controller-manager"), server=False, san=None)

    make_extender_pki(d)

    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (d / "sa.key").write_bytes(_pem_key(sa))
    (d / "sa.pub").write_bytes(
        sa.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return Pki(d)
