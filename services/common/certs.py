"""A private CA and one certificate per service role, for mutual TLS between kvrelay's services.

Each leaf certificate names its role twice: as the subject's organizational unit, which the
servers read to decide what a peer may call (authz.py), and as the DNS name
`<role>.kvrelay.internal`, which clients check the server against (so a worker's certificate
cannot stand in for the scheduler's, whatever address it was dialled on). `kvrelay certs` writes
them; `kvrelay up --tls` makes a throwaway set for the local stack.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvrelay.common.tls import server_name

# gateway, tokenizer and scheduler are services; both worker kinds share "worker" (either may
# push KV to the other); "admin" is for operators and tools: health and Stats, nothing else.
ROLES = ("gateway", "tokenizer", "scheduler", "worker", "admin")
ORGANIZATION = "kvrelay"
CA_DAYS = 3650
LEAF_DAYS = 365


@dataclass(frozen=True)
class Authority:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, common_name: str = "kvrelay local CA", days: int = CA_DAYS) -> "Authority":
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                          x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        start = _now() - datetime.timedelta(minutes=5)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                             False, False), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(key, cert)

    @classmethod
    def load(cls, cert_path: str | Path, key_path: str | Path) -> "Authority":
        cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
        key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
        return cls(key, cert)

    def issue(self, role: str, extra_names: tuple[str, ...] = (), days: int = LEAF_DAYS,
              not_before: datetime.datetime | None = None) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) for `role`, valid for both ends of a connection.
        `extra_names`: more DNS names or IP addresses it may be dialled by."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                             x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                             x509.NameAttribute(NameOID.COMMON_NAME, server_name(role))])
        start = not_before or _now() - datetime.timedelta(minutes=5)
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(_alt_names(role, extra_names)),
                               critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(self.key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)

    def revocation_list(self, serials: list[int], days: int = 30) -> bytes:
        """A CRL (PEM) naming the certificates with these serial numbers as revoked."""
        now = _now()
        builder = (x509.CertificateRevocationListBuilder().issuer_name(self.cert.subject)
                   .last_update(now).next_update(now + datetime.timedelta(days=days)))
        for serial in sorted(set(serials)):
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(serial)
                .revocation_date(now).build())
        return builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return _key_pem(self.key)


def write_bundle(out_dir: str | Path, roles: tuple[str, ...] = ROLES,
                 extra_names: tuple[str, ...] = (), authority: Authority | None = None,
                 days: int = LEAF_DAYS) -> Path:
    """Write ca.pem (with ca-key.pem and an empty crl.pem when the CA is new) plus <role>.pem
    and <role>-key.pem for each role into `out_dir`. Keys are readable by their owner only."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if authority is None:
        authority = Authority.create()
        write_file(out / "ca-key.pem", authority.key_pem(), secret=True)
        write_file(out / "crl.pem", authority.revocation_list([]))
    write_file(out / "ca.pem", authority.cert_pem())
    for role in roles:
        cert_pem, key_pem = authority.issue(role, extra_names, days)
        write_file(out / f"{role}.pem", cert_pem)
        write_file(out / f"{role}-key.pem", key_pem, secret=True)
    return out


def _alt_names(role: str, extra_names: tuple[str, ...]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(server_name(role)), x509.DNSName("localhost"),
                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for extra in extra_names:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(extra)))
        except ValueError:
            names.append(x509.DNSName(extra))
    return names


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_file(path: Path, data: bytes, secret: bool = False) -> None:
    # Written to a temporary name and renamed, so a server reloading its files (rotation)
    # never reads half a certificate; created 0600 from the start when secret.
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)
