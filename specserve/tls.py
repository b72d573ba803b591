"""Mutual TLS on the draft -> target gRPC stream (optional).

Owns turning the config's `grpc_tls` section (CA, certificate and key files)
into gRPC credentials for both ends: the target's draft sink (server, requires
a client certificate signed by the CA) and a draft's SinkLink (client, checks
the sink's certificate against the CA). Files are read where they are used, on
the node of the sink or the draft, so a missing file fails there with its path.

The sink gets its files with its other settings
(`specserve.target.sink_settings.SinkSettings`). Never touches the HTTP side.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

# The name a draft's certificate carries (its common name or a subject
# alternative name) for the sink to take it as a draft: a certificate the CA
# signed for anything else (a target's own) opens no draft stream.
DRAFT_ROLE = "specserve-draft"


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    ca_file: str
    cert_file: str
    key_file: str
    server_name: str | None = None  # name to check in the sink's certificate
    # names of which a draft's certificate must carry one (sink side; empty: any
    # certificate the CA signed)
    draft_names: tuple[str, ...] = (DRAFT_ROLE,)

    @classmethod
    def from_config(cls, section) -> TlsFiles | None:
        """From `AppConfig.grpc_tls` (a GrpcTlsConfig, a dict or None)."""
        if section is None:
            return None
        d = section if isinstance(section, dict) else section.model_dump()
        return cls(d["ca_file"], d["cert_file"], d["key_file"], d.get("server_name"),
                   tuple(d.get("draft_names", (DRAFT_ROLE,))))

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(CA, certificate, key) bytes; a missing file names itself and the fix."""
        out = []
        for field in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, field)
            if not path or not Path(path).is_file():
                raise FileNotFoundError(
                    f"grpc_tls.{field}: {path!r} is not a file on this node; every draft and "
                    "target node needs the CA, its certificate and its key at these paths")
            out.append(Path(path).read_bytes())
        return out[0], out[1], out[2]


def draft_role_problem(auth_context: dict, names: tuple[str, ...]) -> str | None:
    """Why a verified peer is not a draft (None: it is): its certificate's
    common name and subject alternative names (gRPC's auth context) carry
    none of `names`. Empty `names`: any certificate the CA signed."""
    if not names:
        return None
    carried = {v.decode(errors="replace") if isinstance(v, bytes) else str(v)
               for key in ("x509_common_name", "x509_subject_alternative_name")
               for v in auth_context.get(key, ())}
    if carried & set(names):
        return None
    return (f"this certificate is not a draft's: it names {sorted(carried)}, a draft's names "
            f"one of {sorted(names)} (grpc_tls.draft_names)")


def server_credentials(files: TlsFiles):
    """The sink's credentials: its certificate, and client certificates required."""
    import grpc

    ca, cert, key = files.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=True)


def channel_credentials(files: TlsFiles):
    """A draft's credentials: check the sink against the CA, present our certificate."""
    import grpc

    ca, cert, key = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)


def channel_options(files: TlsFiles | None) -> list[tuple[str, str]]:
    """Sinks are dialled by IP; server_name says which name their certificate carries."""
    if files is not None and files.server_name:
        return [("grpc.ssl_target_name_override", files.server_name)]
    return []
