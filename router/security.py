"""Secrets hygiene: constant-time key checks, per-key concurrency limits, redacted log lines."""

from __future__ import annotations

import hmac
import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from .config import AuthConfig, ConfigError

# scheme://user:password@host -> scheme://user:***@host (also a bare :password@ as in redis://:pw@h)
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]+)@")
_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+")


def redact(text: str) -> str:
    """Any URL password and bearer token in `text` replaced by ***."""
    text = _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    return _BEARER.sub(r"\1***", text)


def redact_url(url: str) -> str:
    return redact(url)


class RedactingFilter(logging.Filter):
    """Attach to a handler: every record it emits has URL passwords and bearer tokens masked."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string is logging's problem, not ours
            return True
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Add a RedactingFilter to every handler of `logger` (default: root) that lacks one."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def constant_time_in(candidate: str, secrets: Iterable[bytes]) -> int | None:
    """Index of the secret equal to `candidate`, comparing with every secret in constant time
    (no early exit, so timing tells nothing about which key or prefix matched)."""
    given = candidate.encode("utf-8", "surrogateescape")
    found: int | None = None
    for i, secret in enumerate(secrets):
        if hmac.compare_digest(given, secret) and found is None:
            found = i
    return found


def bearer_token(headers: Mapping[str, str]) -> str | None:
    value = headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def load_api_keys(config: AuthConfig, environ: Mapping[str, str] | None = None) -> tuple[bytes, ...]:
    env = os.environ if environ is None else environ
    keys: list[str] = []
    if config.api_keys_env:
        keys += [k.strip() for k in env.get(config.api_keys_env, "").split(",")]
    if config.api_keys_file:
        try:
            keys += [line.strip() for line in Path(config.api_keys_file).read_text().splitlines()]
        except OSError as err:
            raise ConfigError(f"auth.api_keys_file: cannot read ({err.strerror})") from None
    return tuple(dict.fromkeys(k.encode() for k in keys if k and not k.startswith("#")))


class KeyLimiter:
    """In-flight requests per client key; `acquire` is False when the key is at its limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight: dict[int, int] = {}

    def acquire(self, key: int) -> bool:
        n = self.in_flight.get(key, 0)
        if self.limit and n >= self.limit:
            return False
        self.in_flight[key] = n + 1
        return True

    def release(self, key: int) -> None:
        n = self.in_flight.get(key, 0) - 1
        if n <= 0:
            self.in_flight.pop(key, None)
        else:
            self.in_flight[key] = n


class _ClientProtocolErrors(logging.Filter):
    """aiohttp logs every malformed request (bad header, oversized line, bad method) with a
    traceback; those are the client's fault and already answered 400, so anyone could flood the
    log with them. They are kept at DEBUG only."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG) and record.levelno <= logging.DEBUG
        return True


def quiet_client_protocol_errors() -> None:
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _ClientProtocolErrors) for f in logger.filters):
        logger.addFilter(_ClientProtocolErrors())
