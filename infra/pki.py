"""The project's own certificate authority and one certificate per service, for mutual TLS on gRPC,
and the Kafka brokers' certificates where Kafka's listeners take TLS.

Every gRPC port only answers a caller showing a certificate this CA signed, and a caller only talks to
a server whose certificate names the service it meant to reach (shared/tls.py); the common name *is*
the service's identity. ``ensure_pki`` creates what is missing and leaves valid certificates alone;
``rotate`` issues new service certificates from the same CA (services pick them up when restarted);
deleting the directory makes a new CA. Layout (the stack's ``<run_dir>/pki``, or ``SF_TLS_DIR``):

    ca.crt                      the CA certificate every service trusts
    ca.key                      the CA's private key: needed only to issue certificates, never by a service
    <service>.crt, <service>.key
    kafka-<n>.crt, .key, .pem   a broker's certificate (its addresses as IP SANs); .pem holds both
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.tls import IDENTITIES, server_name

CA_DAYS = 3650
CERT_DAYS = 365
RENEW_BEFORE_DAYS = 30


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


def _key_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_ca(pki: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    try:
        cert = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
        key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    except (OSError, ValueError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or cert.not_valid_after_utc < _now():
        return None
    return cert, key


def _new_ca(pki: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "StreamForge project CA")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write_private(pki / "ca.key", _key_bytes(key))
    (pki / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def issue(
    pki: Path,
    identity: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    extra_dns: Iterable[str] = (),
    extra_ips: Iterable[str] = (),
) -> Path:
    """A certificate for ``identity`` (client and server use), signed by the CA; returns its path.

    It carries the DNS names ``<identity>.streamforge`` and ``streamforge`` (what clients check: see
    shared/tls.py), ``<identity>`` and ``localhost``, plus the IP 127.0.0.1 and ``extra_ips``."""
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    names: list[x509.GeneralName] = [
        x509.DNSName(n)
        for n in dict.fromkeys([server_name(identity), server_name(None), identity, "localhost", *extra_dns])
    ]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in dict.fromkeys(["127.0.0.1", *extra_ips])]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=CERT_DAYS), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(pki / f"{identity}.key", _key_bytes(key))
    path = pki / f"{identity}.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _valid(pki: Path, identity: str, ca_cert: x509.Certificate) -> bool:
    try:
        cert = x509.load_pem_x509_certificate((pki / f"{identity}.crt").read_bytes())
        (pki / f"{identity}.key").stat()
    except (OSError, ValueError):
        return False
    fresh = cert.not_valid_after_utc - _now() > dt.timedelta(days=RENEW_BEFORE_DAYS)
    return fresh and cert.issuer == ca_cert.subject


def _serves(pki: Path, identity: str, ca_cert: x509.Certificate, addresses: set[str]) -> bool:
    """Valid, signed by this very CA (a remade one has the same name) and naming every address."""
    if not _valid(pki, identity, ca_cert):
        return False
    cert = x509.load_pem_x509_certificate((pki / f"{identity}.crt").read_bytes())
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return addresses <= {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}


def ensure_pem_keystore(pki: Path, identity: str, addresses: Iterable[str]) -> Path:
    """``<identity>.pem``: the key and certificate of a server reached at ``addresses`` (IP SANs), in
    one 0600 file as Kafka's PEM keystore takes it. Reissued when missing, stale or short of an address;
    the CA is made if there is none yet."""
    ca = _load_ca(pki) or _new_ca(pki)
    wanted = set(addresses)
    if not _serves(pki, identity, ca[0], wanted):
        issue(pki, identity, ca, extra_ips=sorted(wanted))
    path = pki / f"{identity}.pem"
    _write_private(path, (pki / f"{identity}.key").read_bytes() + (pki / f"{identity}.crt").read_bytes())
    return path


def ensure_pki(pki: Path, identities: Iterable[str] = IDENTITIES) -> list[str]:
    """Create the CA and the certificates that are missing, expired or soon to expire; returns the
    identities it issued a certificate for."""
    ca = _load_ca(pki)
    renewed_ca = ca is None
    if ca is None:
        ca = _new_ca(pki)
    issued = []
    for identity in identities:
        if renewed_ca or not _valid(pki, identity, ca[0]):
            issue(pki, identity, ca)
            issued.append(identity)
    return issued


def rotate(pki: Path, identities: Iterable[str] = IDENTITIES) -> list[str]:
    """New certificates (and keys) for every identity, from the same CA."""
    ca = _load_ca(pki) or _new_ca(pki)
    return [issue(pki, identity, ca).stem for identity in identities]
