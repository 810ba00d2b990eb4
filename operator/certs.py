"""The webhook's certificates, made with `cryptography`: a CA that lives ten years and a serving
certificate that lives one, renewed when a third of its life is left or its names changed.
Pure functions of their inputs and the clock (keys are random); no I/O."""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_LIFETIME = timedelta(days=3650)
SERVING_LIFETIME = timedelta(days=365)
BACKDATE = timedelta(minutes=5)  # tolerate an apiserver clock a little behind ours


@dataclass(frozen=True)
class CertBundle:
    ca_cert: bytes  # PEM
    ca_key: bytes
    cert: bytes
    key: bytes
    ca_bundle: bytes  # what the apiserver trusts: this CA, plus the previous one while it lasts


def service_names(service: str, namespace: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    base = (service, f"{service}.{namespace}", f"{service}.{namespace}.svc")
    return (*base, f"{service}.{namespace}.svc.cluster.local", *extra)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san(names: tuple[str, ...]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def new_ca(now: datetime, common_name: str = "kvbank-webhook-ca") -> tuple[bytes, bytes]:
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + CA_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def new_serving(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    names: tuple[str, ...],
    now: datetime,
    lifetime: timedelta = SERVING_LIFETIME,
) -> tuple[bytes, bytes]:
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = _key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(min(now + lifetime, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(_san(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def serial_and_expiry(cert_pem: bytes) -> tuple[str, datetime]:
    cert = x509.load_pem_x509_certificate(cert_pem)
    return format(cert.serial_number, "x"), cert.not_valid_after_utc


def fingerprint(cert_pem: bytes) -> str:
    """A short name for a CA bundle, to tell when the CA that signed a certificate changed."""
    return hashlib.sha256(cert_pem).hexdigest()[:16]


def _expiring(cert_pem: bytes, lifetime: timedelta, now: datetime) -> bool:
    cert = x509.load_pem_x509_certificate(cert_pem)
    return cert.not_valid_after_utc - now < lifetime / 3


def _names(cert_pem: bytes) -> set[str]:
    cert = x509.load_pem_x509_certificate(cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(n) for n in san.get_values_for_type(x509.DNSName)} | {
        str(ip) for ip in san.get_values_for_type(x509.IPAddress)
    }


def _valid(cert_pem: bytes, now: datetime) -> bool:
    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc > now


def issue(existing: CertBundle | None, names: tuple[str, ...], now: datetime) -> CertBundle | None:
    """A new bundle when `existing` is missing, unreadable, expiring or for other names; None
    when it is still good. A renewed CA is bundled with the previous one while that lasts, so
    an apiserver that has not yet seen the new bundle still trusts the old serving cert."""
    try:
        if existing is not None:
            ca_ok = not _expiring(existing.ca_cert, CA_LIFETIME, now)
            serving_ok = not _expiring(existing.cert, SERVING_LIFETIME, now)
            if ca_ok and serving_ok and _names(existing.cert) == set(names):
                return None
            if ca_ok:
                cert, key = new_serving(existing.ca_cert, existing.ca_key, names, now)
                return CertBundle(existing.ca_cert, existing.ca_key, cert, key, existing.ca_bundle)
    except (ValueError, x509.ExtensionNotFound):
        existing = None  # unreadable: start over
    ca_cert, ca_key = new_ca(now)
    cert, key = new_serving(ca_cert, ca_key, names, now)
    bundle = ca_cert
    if existing is not None and _valid(existing.ca_cert, now):
        bundle += existing.ca_cert
    return CertBundle(ca_cert, ca_key, cert, key, bundle)
