"""Throwaway certificates for tests of mutual TLS (never for production).

`make_pki(folder)` writes a CA; a server certificate for the draft sink (names
`specserve-sink`, `localhost`, 127.0.0.1, and the draft role's name,
specserve.tls.DRAFT_ROLE: one certificate both ends may present, as the Helm
chart's); a client certificate for drafts (the draft role's name); a
certificate for something else (not a draft), all signed by the CA; plus a
second, unrelated CA with its own draft certificate (a draft the sink must
refuse). EC P-256 keys, valid for a day.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from specserve.tls import DRAFT_ROLE

SERVER_NAME = "specserve-sink"


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(folder: Path, name: str, key, cert) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization

    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def _cert(subject: str, key, issuer_name, issuer_key, ca: bool, sans=()):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    b = (x509.CertificateBuilder().subject_name(name)
         .issuer_name(issuer_name or name).public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:  # one certificate may serve both ends (the config has one cert_file)
        b = b.add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_pki(folder: Path) -> dict[str, str]:
    """Paths: ca, server_cert, server_key, client_cert, client_key, other_cert,
    other_key, rogue_ca, rogue_cert, rogue_key."""
    from cryptography import x509

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, str] = {}
    for prefix, ca_name in (("", "specserve test CA"), ("rogue_", "rogue CA")):
        ca_key = _key()
        ca = _cert(ca_name, ca_key, None, ca_key, ca=True)
        out[f"{prefix}ca" if prefix else "ca"], _ = _write(folder, f"{prefix}ca", ca_key, ca)
        client_key = _key()
        client = _cert(DRAFT_ROLE, client_key, ca.subject, ca_key, ca=False,
                       sans=[x509.DNSName(DRAFT_ROLE)])
        c, k = _write(folder, f"{prefix}client", client_key, client)
        if prefix:
            out["rogue_cert"], out["rogue_key"] = c, k
        else:
            out["client_cert"], out["client_key"] = c, k
            server_key = _key()
            sans = [x509.DNSName(SERVER_NAME), x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName(DRAFT_ROLE)]
            server = _cert(SERVER_NAME, server_key, ca.subject, ca_key, ca=False, sans=sans)
            out["server_cert"], out["server_key"] = _write(folder, "server", server_key, server)
            other_key = _key()
            other = _cert("not-a-draft", other_key, ca.subject, ca_key, ca=False,
                          sans=[x509.DNSName("not-a-draft")])
            out["other_cert"], out["other_key"] = _write(folder, "other", other_key, other)
    return out
