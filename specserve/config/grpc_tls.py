"""Mutual TLS on the draft -> target gRPC stream in the config (`grpc_tls:`):
the CA, this replica's certificate and key, the name drafts expect in a
sink's certificate, and the names a draft's certificate must carry. Part of
`AppConfig` (specserve/config/schema.py); the channels and the check of a
draft's certificate are `specserve.tls`."""

from __future__ import annotations

from pydantic import Field, field_validator

from specserve.config.base import _require_non_empty, _Strict


class GrpcTlsConfig(_Strict):
    """Mutual TLS on the draft -> target gRPC stream. Each file must exist on every
    node that runs a draft or target replica (checked there, when used)."""

    ca_file: str = Field(
        description="PEM file of the CA that signed the sinks' and drafts' certificates; "
                    "both ends check the other's certificate against it.")
    cert_file: str = Field(
        description="PEM certificate this replica presents: the sink's server certificate "
                    "on targets, the client certificate on drafts.")
    key_file: str = Field(description="PEM private key of cert_file.")
    server_name: str | None = Field(
        None,
        description="Name drafts expect in the sink's certificate (sinks are dialled by IP "
                    "address). Null: the address itself must be in the certificate.")
    draft_names: list[str] = Field(
        default_factory=lambda: ["specserve-draft"],
        description="Names of which a draft's certificate must carry one (its common name or "
                    "a subject alternative name): the sink refuses other certificates the CA "
                    "signed (a target's own) with PERMISSION_DENIED. Empty: any certificate "
                    "the CA signed.")

    @field_validator("ca_file", "cert_file", "key_file", "server_name")
    @classmethod
    def _not_empty(cls, v, info):
        return _require_non_empty(v, info.field_name)
