"""Documents given by URI: which URIs are allowed, and fetching them without being turned
against the server's own network (SSRF).

A URI is allowed only when it starts with a configured prefix, carries no credentials and no
`..` segment, and, for HTTP(S), when every address its host resolves to is public (or inside an
explicitly allowed network). The fetch then connects to the address that was checked, not to a
fresh DNS answer, and each redirect is checked again like a new URI. Errors and logs show URIs
without user info, query or fragment, which may hold tokens (presigned URLs).
"""

from __future__ import annotations

import asyncio
import ipaddress
import posixpath
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, unquote, urljoin, urlsplit

import httpx

from serving.config import UriConfig

MAX_URI_CHARS = 4096
DEFAULT_PORTS = {"http": 80, "https": 443}
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class UriRefused(Exception):
    """A URI the policy does not allow; the message says why, for the client."""


class FetchError(Exception):
    """An allowed URI that could not be read; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class AllowedUri:
    uri: str
    scheme: str
    host: str
    port: int | None
    path: str
    addresses: tuple[str, ...] = ()  # checked addresses of an HTTP(S) host, to connect to

    @property
    def name(self) -> str:
        """The file name that tells the parser the format."""
        return posixpath.basename(unquote(self.path)) or self.host

    @property
    def redacted(self) -> str:
        return redact_uri(self.uri)


@dataclass(frozen=True)
class FetchedDocument:
    name: str
    data: bytes
    mime_type: str | None


def redact_uri(uri: str) -> str:
    """The URI without user info, query and fragment, safe to log and to show."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "(unparseable URI)"
    if not parts.scheme:
        return uri.split("?", 1)[0].split("#", 1)[0]
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


@dataclass(frozen=True)
class _Prefix:
    scheme: str
    host: str  # "" matches any host
    port: int | None
    path: str

    @classmethod
    def parse(cls, prefix: str) -> _Prefix:
        parts = urlsplit(prefix.strip())
        scheme = parts.scheme.lower()
        return cls(scheme, _canonical_host(parts), _port(parts, scheme), parts.path)

    def matches(self, uri: AllowedUri) -> bool:
        if uri.scheme != self.scheme:
            return False
        if self.host and (uri.host != self.host or uri.port != self.port):
            return False
        if self.path in ("", "/") or uri.path == self.path:
            return True
        boundary = self.path if self.path.endswith("/") else self.path + "/"
        return uri.path.startswith(boundary)


class UriPolicy:
    def __init__(self, config: UriConfig) -> None:
        self.config = config
        self._prefixes = [_Prefix.parse(prefix) for prefix in config.allowed_prefixes]
        self._networks: list[IPNetwork] = [
            ipaddress.ip_network(network, strict=False) for network in config.allowed_networks
        ]

    async def check(self, uri: str) -> AllowedUri:
        allowed = self._check_form(uri)
        if allowed.scheme in DEFAULT_PORTS:
            addresses = await self._resolve(allowed)
            allowed = AllowedUri(**{**allowed.__dict__, "addresses": addresses})
        return allowed

    def _check_form(self, uri: str) -> AllowedUri:
        uri = uri.strip()
        if not uri:
            raise UriRefused("the URI is empty")
        if len(uri) > MAX_URI_CHARS:
            raise UriRefused(f"the URI is longer than {MAX_URI_CHARS} characters")
        shown = redact_uri(uri)
        if not self._prefixes:
            raise UriRefused("documents by URI are not enabled on this server")
        try:
            parts = urlsplit(uri)
        except ValueError:
            raise UriRefused(f"{shown} is not a valid URI") from None
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https", "s3"):
            what = "a local path" if not scheme or scheme == "file" else f"a {scheme}:// URI"
            raise UriRefused(f"{shown} is {what}; only http(s):// and s3:// URIs can be fetched")
        if parts.username is not None or parts.password is not None:
            raise UriRefused(f"{shown}: credentials in URIs are not accepted")
        host = _canonical_host(parts)
        if not host:
            raise UriRefused(f"{shown} names no host")
        try:
            port = _port(parts, scheme)
        except ValueError:
            raise UriRefused(f"{shown} has an invalid port") from None
        if ".." in unquote(parts.path).split("/") or "\\" in unquote(parts.path):
            raise UriRefused(f"{shown}: '..' and backslashes are not allowed in the path")
        if scheme == "s3" and not parts.path.strip("/"):
            raise UriRefused(f"{shown} names a bucket but no object")
        allowed = AllowedUri(uri, scheme, host, port, parts.path)
        if not any(prefix.matches(allowed) for prefix in self._prefixes):
            raise UriRefused(f"{shown} is not under an allowed URI prefix of this server")
        return allowed

    async def _resolve(self, uri: AllowedUri) -> tuple[str, ...]:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(uri.host, uri.port, type=socket.SOCK_STREAM),
                self.config.fetch_timeout_s,
            )
        except (OSError, asyncio.TimeoutError):
            raise UriRefused(f"{uri.redacted}: the host name does not resolve") from None
        addresses = tuple(dict.fromkeys(str(info[4][0]) for info in infos))
        if not addresses:
            raise UriRefused(f"{uri.redacted}: the host name does not resolve")
        for address in addresses:
            if not self._reachable(ipaddress.ip_address(address.split("%", 1)[0])):
                raise UriRefused(
                    f"{uri.redacted}: the host resolves to a loopback, private, link-local or "
                    "otherwise internal address, which this server does not fetch from"
                )
        return addresses

    def _reachable(self, address: IPAddress) -> bool:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if any(address in network for network in self._networks):
            return True
        return address.is_global and not address.is_multicast


class DocumentFetcher:
    """Reads the bytes behind an allowed URI, at most `max_bytes` of them."""

    def __init__(self, policy: UriPolicy, max_bytes: int) -> None:
        self.policy = policy
        self.config = policy.config
        self.max_bytes = max_bytes

    async def fetch(self, uri: str) -> FetchedDocument:
        allowed = await self.policy.check(uri)
        if allowed.scheme == "s3":
            return await asyncio.to_thread(self._fetch_s3, allowed)
        return await self._fetch_http(allowed)

    async def _fetch_http(self, allowed: AllowedUri) -> FetchedDocument:
        timeout = httpx.Timeout(self.config.fetch_timeout_s)
        # trust_env=False: a proxy from the environment would connect to the host by name.
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            for _ in range(self.config.max_redirects + 1):
                try:
                    response = await client.send(_pinned_request(client, allowed), stream=True)
                except httpx.HTTPError as error:
                    raise FetchError(
                        502, f"cannot fetch {allowed.redacted}: {type(error).__name__}"
                    ) from None
                try:
                    if response.is_redirect and "location" in response.headers:
                        target = urljoin(allowed.uri, response.headers["location"])
                        allowed = await self.policy.check(target)
                        continue
                    return await self._read_body(allowed, response)
                finally:
                    await response.aclose()
        raise FetchError(
            422, f"{allowed.redacted}: more than {self.config.max_redirects} redirects"
        )

    async def _read_body(self, allowed: AllowedUri, response: httpx.Response) -> FetchedDocument:
        if response.status_code >= 400:
            status = 502 if response.status_code >= 500 else 422
            raise FetchError(status, f"{allowed.redacted} answered HTTP {response.status_code}")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise self._too_large(allowed)
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > self.max_bytes:
                    raise self._too_large(allowed)
                chunks.append(chunk)
        except httpx.HTTPError as error:
            raise FetchError(
                502, f"cannot fetch {allowed.redacted}: {type(error).__name__}"
            ) from None
        return FetchedDocument(allowed.name, b"".join(chunks), response.headers.get("content-type"))

    def _fetch_s3(self, allowed: AllowedUri) -> FetchedDocument:
        from botocore.exceptions import BotoCoreError, ClientError

        from connectors.base import SourceError
        from connectors.s3 import S3Source
        from operators.core.document import Document

        object_uri = f"s3://{allowed.host}{allowed.path}"
        source = S3Source(object_uri, endpoint_url=self.config.s3_endpoint_url, max_attempts=3)
        try:
            head = source.client.head_object(Bucket=allowed.host, Key=allowed.path.lstrip("/"))
        except (ClientError, BotoCoreError):
            head = {}  # read_bytes below says what is wrong, in the connector's words
        if int(head.get("ContentLength") or 0) > self.max_bytes:
            raise self._too_large(allowed)
        try:
            data = source.read_bytes(Document(uri=object_uri, name=allowed.name))
        except SourceError as error:
            status = 502 if str(error).startswith("cannot reach") else 422
            raise FetchError(status, str(error)) from None
        if len(data) > self.max_bytes:
            raise self._too_large(allowed)
        return FetchedDocument(allowed.name, data, head.get("ContentType"))

    def _too_large(self, allowed: AllowedUri) -> FetchError:
        return FetchError(
            413, f"{allowed.redacted} is larger than the input limit of {self.max_bytes:,} bytes"
        )


def _pinned_request(client: httpx.AsyncClient, allowed: AllowedUri) -> httpx.Request:
    """A GET to the checked address, with the original host for Host, SNI and certificates."""
    address = allowed.addresses[0]
    literal = f"[{address}]" if ":" in address else address
    default_port = DEFAULT_PORTS[allowed.scheme]
    port = f":{allowed.port}" if allowed.port and allowed.port != default_port else ""
    query = urlsplit(allowed.uri).query
    url = f"{allowed.scheme}://{literal}:{allowed.port or default_port}{allowed.path or '/'}"
    if query:
        url += f"?{query}"
    extensions: dict[str, Any] = {}
    if allowed.scheme == "https":
        extensions["sni_hostname"] = allowed.host
    headers = {"Host": f"{allowed.host}{port}", "User-Agent": "memstream"}
    return client.build_request("GET", url, headers=headers, extensions=extensions)


def _canonical_host(parts: SplitResult) -> str:
    if parts.scheme.lower() == "s3":
        return parts.netloc  # the bucket
    host = (parts.hostname or "").rstrip(".")
    try:
        return host.encode("idna").decode("ascii").lower()
    except UnicodeError:
        return host.lower()


def _port(parts: SplitResult, scheme: str) -> int | None:
    if scheme == "s3":
        return None
    return parts.port or DEFAULT_PORTS.get(scheme)
