"""The job's shared token and the loopback rule, for every process that serves: a PS shard
(deeprec.distributed.ps.security adds gRPC's interceptor and TLS) and `deeprec serve`.

    token   the first line of a --token-file, else DEEPREC_PS_TOKEN (deeprec launch makes one per
            job and hands it over in the environment, never in argv); compared in constant time
    bind    loopback unless configured otherwise: a non-loopback address wants a token
"""
from __future__ import annotations

import os

from deeprec.errors import ConfigError, regular_file

TOKEN_ENV = "DEEPREC_PS_TOKEN"


def read_token(token_file: str | None = None) -> str | None:
    """The job's token: the file's first line, else DEEPREC_PS_TOKEN, else None."""
    if token_file:
        regular_file(token_file, "--token-file")
        try:
            with open(token_file) as f:
                token = f.readline().strip()
        except OSError as err:
            raise ConfigError(f"cannot read the token file {token_file!r}: {err.strerror}") from None
        if not token:
            raise ConfigError(f"the token file {token_file!r} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def is_loopback(bind: str) -> bool:
    host = bind.rpartition(":")[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
