"""The serving configuration: typed records, read from YAML and checked before anything starts.

Every field has an embedded default (a private local Ray instance, the default packaged model on
the CPU, a SQLite store in the user's state folder), so `memstream serve` runs without a file.
A YAML file overrides any subset; it is read as every configuration is (`operators.config.
parse_config`): unknown keys and wrong values are refused with the dotted path of the key.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field

from connectors.engines.factory import EngineSpec
from operators.config import (
    STRICT_KEYS,
    ConfigError,
    DocumentLimits,
    MethodConfig,
    parse_config,
    with_measured_defaults,
)

MIB = 1 << 20
MIN_API_KEY_CHARS = 16
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})


@dataclass(frozen=True)
class ServerConfig:
    """Where the HTTP API listens."""

    host: Annotated[str, Field(description="listen address; any but loopback needs API keys")] = (
        "127.0.0.1"
    )
    port: Annotated[int, Field(description="listen port, 1 to 65535")] = 8000

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")

    @property
    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)


@dataclass(frozen=True)
class RayConfig:
    # "local" starts a private Ray instance for this server; "auto" or host:port joins a cluster.
    address: str = "local"
    num_cpus: int | None = None  # of the private instance; default: the machine's
    object_store_memory_mib: int = 512  # of the private instance
    include_dashboard: bool = False


@dataclass(frozen=True)
class AutoscalingConfig:
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 64.0

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas):
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                f"{self.min_replicas}..{self.max_replicas}"
            )
        if self.target_ongoing_requests <= 0:
            raise ValueError("target_ongoing_requests must be positive")

    def as_serve_options(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DeploymentConfig:
    """Replicas of one Serve deployment: a fixed count, or autoscaling when that is set."""

    num_replicas: int = 1
    autoscaling: AutoscalingConfig | None = None
    max_ongoing_requests: int = 256
    num_cpus: float = 1.0
    # Serve checks every replica's health this often; a replica that fails the check, or does
    # not answer within the timeout, three times in a row is replaced by a new one.
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {self.num_replicas}")
        if self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be at least 1")
        if self.num_cpus < 0:
            raise ValueError("num_cpus must not be negative")
        if self.health_check_period_s <= 0 or self.health_check_timeout_s <= 0:
            raise ValueError("health_check_period_s and health_check_timeout_s must be positive")

    def serve_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": self.num_cpus},
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
        }
        if self.autoscaling is not None:
            options["autoscaling_config"] = self.autoscaling.as_serve_options()
        else:
            options["num_replicas"] = self.num_replicas
        return options


def default_store_url() -> str:
    import platformdirs

    folder = Path(platformdirs.user_state_dir("memstream"))
    return f"sqlite:///{folder / 'serving.db'}"


@dataclass(frozen=True)
class StoreConfig:
    url: str = field(default_factory=default_store_url)  # SQLAlchemy URL: sqlite or postgresql


@dataclass(frozen=True)
class LimitsConfig:
    max_body_bytes: int = 16 * MIB  # of one HTTP request body; larger ones get 413
    max_input_bytes: int = 8 * MIB  # of one document: uploaded, inline or fetched
    max_questions: int = 16
    max_question_chars: int = 2000
    # Of the parsed document (characters, tokens, PDF pages, decompressed bytes): over one, 413.
    document: DocumentLimits = field(default_factory=DocumentLimits)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_input_bytes", "max_questions", "max_question_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_body_bytes < self.max_input_bytes:
            raise ValueError("max_body_bytes must be at least max_input_bytes")


@dataclass(frozen=True)
class AuthConfig:
    # Keys are always required on a host that is not loopback; this requires them on loopback too.
    require_keys: bool = False
    api_keys: tuple[str, ...] = ()  # prefer the environment variable below to keys in a file
    api_keys_env: str = "MEMSTREAM_API_KEYS"  # comma-separated keys

    def keys(self) -> tuple[str, ...]:
        from_env = os.environ.get(self.api_keys_env, "") if self.api_keys_env else ""
        keys = [*self.api_keys, *(key.strip() for key in from_env.split(","))]
        found = tuple(dict.fromkeys(key for key in keys if key))
        short = [key for key in found if len(key) < MIN_API_KEY_CHARS]
        if short:
            raise ConfigError(
                f"auth: {len(short)} API key(s) shorter than {MIN_API_KEY_CHARS} characters; "
                "use long random keys, such as Python's secrets.token_hex(24)"
            )
        return found


@dataclass(frozen=True)
class UriConfig:
    # A document may be given as a URI only when it starts with one of these, e.g.
    # "https://docs.example.com/reports/", "s3://bucket/prefix/". A bare "https://" allows any
    # host over HTTPS. Empty: URIs are refused.
    allowed_prefixes: tuple[str, ...] = ()
    # HTTP(S) hosts must resolve to public addresses; these networks (CIDR) are allowed as well.
    allowed_networks: tuple[str, ...] = ()
    s3_endpoint_url: str | None = None  # S3-compatible store; default: AWS
    fetch_timeout_s: float = 30.0
    max_redirects: int = 3

    def __post_init__(self) -> None:
        for prefix in self.allowed_prefixes:
            scheme = prefix.split("://", 1)[0].lower() if "://" in prefix else ""
            if scheme not in ("http", "https", "s3"):
                raise ValueError(
                    f"allowed prefix {prefix!r} must start with http://, https:// or s3://"
                )
        for network in self.allowed_networks:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError as error:
                raise ValueError(f"allowed network {network!r}: {error}") from None
        if self.fetch_timeout_s <= 0 or self.max_redirects < 0:
            raise ValueError("fetch_timeout_s must be positive and max_redirects not negative")


@dataclass(frozen=True)
class JobsConfig:
    max_running_per_replica: int = 16
    # A replica holds a lease on each job it runs and renews it; a job whose lease ran out (its
    # replica died) is taken over by another replica and resumes from its last checkpoint.
    lease_s: float = 30.0
    poll_interval_s: float = 0.5  # how often replicas look for jobs and event streams for events

    def __post_init__(self) -> None:
        if self.max_running_per_replica < 1:
            raise ValueError("max_running_per_replica must be at least 1")
        if self.lease_s < 3 * self.poll_interval_s or self.poll_interval_s <= 0:
            raise ValueError("need poll_interval_s > 0 and lease_s >= 3 * poll_interval_s")


def _default_engine_deployment() -> DeploymentConfig:
    return DeploymentConfig(num_cpus=1.0, max_ongoing_requests=256)


def _default_ingress_deployment() -> DeploymentConfig:
    return DeploymentConfig(num_cpus=0.5, max_ongoing_requests=256)


@dataclass(frozen=True)
class ServingConfig:
    __pydantic_config__ = STRICT_KEYS

    server: ServerConfig = field(default_factory=ServerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    engine: EngineSpec = field(default_factory=EngineSpec)
    engine_deployment: DeploymentConfig = field(default_factory=_default_engine_deployment)
    ingress_deployment: DeploymentConfig = field(default_factory=_default_ingress_deployment)
    method: MethodConfig = field(default_factory=MethodConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    uris: UriConfig = field(default_factory=UriConfig)
    jobs: JobsConfig = field(default_factory=JobsConfig)

    @property
    def keys_required(self) -> bool:
        return self.auth.require_keys or not self.server.is_loopback

    def with_server(self, host: str | None, port: int | None) -> ServingConfig:
        server = ServerConfig(
            host=host if host is not None else self.server.host,
            port=port if port is not None else self.server.port,
        )
        return dataclasses.replace(self, server=server)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for YAML; API keys are left out."""
        data = dataclasses.asdict(self)
        data["auth"]["api_keys"] = []
        return _plain(data)


def is_loopback_host(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_config(
    path: Path | None, overrides: Mapping[str, Mapping[str, Any]] | None = None
) -> ServingConfig:
    """The embedded defaults, overridden by the YAML file at `path` when given, and that by
    `overrides` (e.g. from command-line flags), section by section."""
    data: Any = {}
    where = "config" if path is None else str(path)
    if path is not None:
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML: {error}") from None
        data = {} if data is None else data
    if overrides and isinstance(data, Mapping):
        data = dict(data)
        for section, values in overrides.items():
            given = data.get(section)
            data[section] = {**given, **values} if isinstance(given, Mapping) else dict(values)
        where += " and the command line" if path is not None else ""
    return config_from_mapping(data, where=where)


# Sections whose defaults differ from their type's: a partial section keeps the other defaults.
SECTION_DEFAULTS = {
    "engine_deployment": _default_engine_deployment,
    "ingress_deployment": _default_ingress_deployment,
}


def config_from_mapping(data: Any, where: str = "config") -> ServingConfig:
    if isinstance(data, Mapping):
        data = with_measured_defaults(data)
        for section, default in SECTION_DEFAULTS.items():
            given = data.get(section)
            if isinstance(given, Mapping):
                data = {**data, section: {**dataclasses.asdict(default()), **given}}
    return parse_config(ServingConfig, data, where)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value
