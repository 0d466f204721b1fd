"""API keys: only their SHA-256 digests leave the process that read them, compared in constant
time; the raw keys never reach Ray, the logs or a response."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from operators.config import ConfigError

if TYPE_CHECKING:
    from serving.config import ServingConfig


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ApiKeys:
    digests: tuple[str, ...] = ()
    required: bool = False

    @classmethod
    def of(cls, keys: Iterable[str], *, required: bool) -> ApiKeys:
        digests = tuple(key_digest(key) for key in keys)
        if required and not digests:
            raise ValueError("API keys are required but none is configured")
        return cls(digests, required)

    def accepts(self, presented: str | None) -> bool:
        if not self.required:
            return True
        if not presented:
            return False
        candidate = key_digest(presented).encode()
        # Every digest is compared, so the time taken does not tell which key came close.
        matched = False
        for digest in self.digests:
            matched |= hmac.compare_digest(candidate, digest.encode())
        return matched


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def api_keys_of(config: ServingConfig) -> ApiKeys:
    """The keys `config` accepts; refuses a server that needs keys and has none."""
    keys = config.auth.keys()
    if config.keys_required and not keys:
        where = (
            "auth.require_keys is set"
            if config.server.is_loopback
            else f"{config.server.host} is not a loopback address"
        )
        raise ConfigError(
            f"refusing to start without API keys: {where}; set {config.auth.api_keys_env} "
            "(comma-separated keys) or auth.api_keys"
        )
    return ApiKeys.of(keys, required=config.keys_required)
