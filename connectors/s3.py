"""Documents in an S3 bucket (AWS or any S3-compatible store), listed page by page.

Objects are read through pyarrow's S3 filesystem, the one the outputs are written with
(connectors.output). The listing stays on boto3's paginator: pyarrow lists a prefix only whole,
as one list built before it returns, and without the objects' ETags; a page of 1,000 keys at a
time keeps a read task flat at any number of objects.

A listing gives each object its `etag` and `last_modified`, not its user metadata
(`x-amz-meta-*`). With `user_metadata` (set by the job when a collection is ordered by another
field, `order_by: metadata.<key>`), each listed object's is fetched by one HEAD request, in the
source's `read_threads` threads, and merged into its metadata.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any
from urllib.parse import urlparse

import boto3
import pyarrow.fs as pafs
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from connectors.base import (
    SourceError,
    SourceUnavailable,
    bounded_map,
    is_hidden,
    is_sidecar,
    parse_sidecar,
)
from connectors.output import (
    S3_CONNECT_TIMEOUT_S,
    S3_MAX_ATTEMPTS,
    S3_REQUEST_TIMEOUT_S,
    missing_aws_credentials,
    s3_filesystem,
)
from operators.core.document import Document

# pyarrow's names (in its OSError messages) of the AWS errors that mean the credentials are
# wrong or lack the right; DENIED_CODES are boto3's.
ARROW_DENIED_CODES = ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH")
ARROW_UNREACHABLE_CODES = ("NETWORK_CONNECTION", "REQUEST_TIMEOUT", "SERVICE_UNAVAILABLE")

# What a listing gives each object; user metadata never overrides them.
LISTED_FIELDS = ("etag", "last_modified")

DENIED_CODES = {
    "403",
    "AccessDenied",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
}


def split_s3_uri(uri: str) -> tuple[str, str]:
    """("bucket", "prefix/key") from s3://bucket/prefix/key."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise SourceError(f"not an S3 URI: {uri!r}: write it as s3://bucket/prefix")
    return parsed.netloc, parsed.path.lstrip("/")


class S3Source:
    """Every object under s3://bucket/prefix, in key order.

    Credentials come from the standard chain (environment, profile, instance role) of boto3
    and of pyarrow's AWS SDK; they are never stored here. The client and the filesystem are
    made on first use in each process, so the source pickles to Ray workers. One shard lists
    the whole prefix, lazily, in a read task, which fetches the objects with `read_threads`
    threads. With `user_metadata`, each object's user metadata too (one HEAD request each);
    without, a listing is one request per page and nothing more.
    """

    read_threads = 8

    def __init__(
        self,
        uri: str,
        endpoint_url: str | None = None,
        region: str | None = None,
        max_attempts: int = S3_MAX_ATTEMPTS,
        retry_mode: str = "standard",
        page_size: int = 1000,
        user_metadata: bool = False,
    ) -> None:
        self.bucket, self.prefix = split_s3_uri(uri)
        self.endpoint_url = endpoint_url
        self.region = region
        self.max_attempts = max_attempts
        self.retry_mode = retry_mode
        self.page_size = page_size
        self.user_metadata = user_metadata
        self._client: Any = None

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"S3Source('s3://{self.bucket}/{self.prefix}'{endpoint})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}

    @property
    def client(self) -> Any:
        if self._client is None:
            config = Config(
                retries={"mode": self.retry_mode, "max_attempts": self.max_attempts},
                connect_timeout=S3_CONNECT_TIMEOUT_S,
                read_timeout=S3_REQUEST_TIMEOUT_S,
            )
            self._client = boto3.session.Session().client(
                "s3", endpoint_url=self.endpoint_url, region_name=self.region, config=config
            )
        return self._client

    def check(self) -> None:
        missing = missing_aws_credentials(f"s3://{self.bucket}")
        if missing:
            raise SourceError(missing)
        try:
            listing = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, f"s3://{self.bucket}") from None
        if not listing.get("Contents"):
            raise SourceError(
                f"no objects under s3://{self.bucket}/{self.prefix}: check the prefix"
            )

    @property
    def filesystem(self) -> pafs.S3FileSystem:
        return _s3_filesystem(self.endpoint_url, self.region, self.max_attempts)

    def documents(self) -> Iterator[Document]:
        for shard in self.shards(1):
            yield from self.shard_documents(shard)

    def shards(self, parallelism: int) -> list[Any]:
        return [self.prefix]

    def sizes(self) -> Iterator[int]:
        for obj in self._list():
            key = obj["Key"]
            if not is_sidecar(key) and not self._hidden(key) and not key.endswith("/"):
                yield int(obj.get("Size") or 0)

    def shard_documents(self, shard: Any) -> Iterator[Document]:
        if not self.user_metadata:
            yield from self._listed_documents()
            return
        threads = max(1, self.read_threads)
        with ThreadPoolExecutor(threads, thread_name_prefix="memstream-s3-head") as pool:
            yield from bounded_map(
                pool, self._with_user_metadata, self._listed_documents(), 2 * threads
            )

    def _listed_documents(self) -> Iterator[Document]:
        # Keys come sorted, so a document's sidecars (its key plus a suffix) come after it and
        # before any key that does not start with it. A document waits in `pending` only while
        # the keys that follow start with its own key: a few documents at most.
        pending: list[tuple[dict[str, Any], list[str]]] = []
        for obj in self._list():
            key = obj["Key"]
            for document in [p for p in pending if not key.startswith(p[0]["Key"])]:
                pending.remove(document)
                yield self._item(*document)
            name = key.rsplit("/", 1)[-1]
            if is_sidecar(name):
                owner = key.rsplit(".questions.", 1)[0]
                for document, sidecars in pending:
                    if document["Key"] == owner:
                        sidecars.append(key)
            elif name and not self._hidden(key):
                pending.append((obj, []))
        for document in pending:
            yield self._item(*document)

    def read_bytes(self, item: Document) -> bytes:
        bucket, key = split_s3_uri(item.uri)
        return self._get(bucket, key)

    def _list(self) -> Iterator[dict[str, Any]]:
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            pages = paginator.paginate(
                Bucket=self.bucket,
                Prefix=self.prefix,
                PaginationConfig={"PageSize": self.page_size},
            )
            for page in pages:
                yield from page.get("Contents", ())
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, f"s3://{self.bucket}/{self.prefix}") from None

    def _hidden(self, key: str) -> bool:
        return any(is_hidden(part) for part in key[len(self.prefix) :].split("/"))

    def _item(self, obj: dict[str, Any], sidecars: list[str]) -> Document:
        questions: tuple[str, ...] = ()
        error = None
        try:
            for sidecar in sidecars:
                questions += parse_sidecar(sidecar, self._get(self.bucket, sidecar))
        except (SourceError, UnicodeDecodeError) as e:
            questions, error = (), f"questions beside s3://{self.bucket}/{obj['Key']}: {e}"
        return Document(
            uri=f"s3://{self.bucket}/{obj['Key']}",
            name=obj["Key"].rsplit("/", 1)[-1],
            size=obj.get("Size"),
            metadata={
                "etag": str(obj.get("ETag", "")).strip('"'),
                "last_modified": obj["LastModified"].isoformat() if "LastModified" in obj else None,
            },
            questions=questions,
            error=error,
        )

    def _with_user_metadata(self, document: Document) -> Document:
        """The document with its object's user metadata (keys in lower case, as S3 gives them)
        beside the listing's fields, which it never overrides. A HEAD request refused for this
        object (gone, denied) is the document's error; S3 unreachable stops the listing, as a
        read does."""
        if document.error is not None:
            return document
        bucket, key = split_s3_uri(document.uri)
        try:
            head = self.client.head_object(Bucket=bucket, Key=key)
        except ClientError as e:
            return replace(document, error=f"its user metadata: {self._error(e, document.uri)}")
        except BotoCoreError as e:
            raise self._error(e, document.uri) from None
        user = {str(name).lower(): value for name, value in (head.get("Metadata") or {}).items()}
        listed = dict(document.metadata or {})
        return replace(document, metadata={**user, **listed})

    def _get(self, bucket: str, key: str) -> bytes:
        try:
            with self.filesystem.open_input_stream(f"{bucket}/{key}") as stream:
                return stream.read()
        except OSError as e:
            raise self._arrow_error(e, f"s3://{bucket}/{key}") from None

    def _arrow_error(self, error: OSError, where: str) -> SourceError:
        """pyarrow's error as one line, like _error's; its messages hold no secret."""
        endpoint = f" at {self.endpoint_url}" if self.endpoint_url else ""
        message = str(error)
        if isinstance(error, FileNotFoundError):
            return SourceError(f"{where} does not exist{endpoint}: was it deleted?")
        code = next((c for c in ARROW_DENIED_CODES if c in message), None)
        if code:
            return SourceError(
                f"access denied to {where}{endpoint} ({code}): check the AWS credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and their rights"
            )
        if any(c in message for c in ARROW_UNREACHABLE_CODES):
            return SourceUnavailable(
                f"cannot reach S3 for {where}{endpoint} after {self.max_attempts} attempts: "
                f"{_first_line(message)}"
            )
        return SourceError(f"S3 error on {where}{endpoint}: {_first_line(message)}")

    def _error(self, error: Exception, where: str) -> SourceError:
        """One line that says what went wrong and what to do, without any secret."""
        endpoint = f" at {self.endpoint_url}" if self.endpoint_url else ""
        if isinstance(error, NoCredentialsError):
            return SourceError(missing_aws_credentials(where) or str(error))
        if isinstance(error, ClientError):
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code == "NoSuchBucket":
                return SourceError(
                    f"bucket {self.bucket!r} does not exist{endpoint}: check the URI"
                )
            if code in ("NoSuchKey", "404"):
                return SourceError(f"{where} does not exist{endpoint}: was it deleted?")
            if code in DENIED_CODES:
                return SourceError(
                    f"access denied to {where}{endpoint} ({code}): check the AWS credentials "
                    "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and their rights"
                )
            message = error.response.get("Error", {}).get("Message", "")
            return SourceError(f"S3 error on {where}{endpoint}: {code} {message}".strip())
        return SourceUnavailable(
            f"cannot reach S3 for {where}{endpoint} after {self.max_attempts} attempts: {error}"
        )


# One per process and settings: its AWS SDK client is costly.
_s3_filesystem = functools.cache(s3_filesystem)


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0] if lines else "unknown error"
