"""Who may talk to a PS: a shared token on every call (deeprec.security reads it), and TLS.

    token   DEEPREC_PS_TOKEN (or a --token-file) on the PS and its workers; every call
            carries it as gRPC metadata and the PS compares it in constant time: a call
            without it, or with another, gets UNAUTHENTICATED. `deeprec launch` makes one
            per job and hands it to its processes through the environment (not argv).
    TLS     the PS: --tls-cert/--tls-key (and --tls-ca to require client certificates);
            workers: DEEPREC_PS_TLS_CA (+ DEEPREC_PS_TLS_CERT/KEY for mutual TLS).

A PS bound to a non-loopback address refuses to start without a token unless --insecure.
"""
from __future__ import annotations

import hmac
import os

import grpc

from deeprec.errors import ConfigError

METADATA_KEY = "deeprec-token"


class TokenInterceptor(grpc.ServerInterceptor):
    """Every call must carry the token; others are refused before any handler runs."""

    def __init__(self, token: str):
        self._token = token.encode()

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a deeprec PS token is required (DEEPREC_PS_TOKEN)")

        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation, handler_call_details):
        given = dict(handler_call_details.invocation_metadata or ()).get(METADATA_KEY, "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._token):
            return continuation(handler_call_details)
        return self._refuse


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise ConfigError(f"cannot read {path!r}: {err.strerror}") from None


def server_credentials(cert: str | None, key: str | None, ca: str | None):
    """gRPC SSL credentials of a PS, or None without a certificate."""
    if not cert and not key:
        if ca:
            raise ConfigError("--tls-ca needs --tls-cert and --tls-key")
        return None
    if not (cert and key):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    root = _read(ca)
    return grpc.ssl_server_credentials([(_read(key), _read(cert))], root_certificates=root,
                                       require_client_auth=root is not None)


def channel(address: str, options: list):
    """A channel to a PS: TLS when DEEPREC_PS_TLS_CA is set, plain otherwise."""
    ca = os.environ.get("DEEPREC_PS_TLS_CA")
    if not ca:
        return grpc.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=_read(ca),
                                         private_key=_read(os.environ.get("DEEPREC_PS_TLS_KEY")),
                                         certificate_chain=_read(os.environ.get("DEEPREC_PS_TLS_CERT")))
    return grpc.secure_channel(address, creds, options=options)


def call_metadata(token: str | None) -> tuple:
    return ((METADATA_KEY, token),) if token else ()
