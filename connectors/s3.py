"""Documents in an S3 bucket (AWS or any S3-compatible store), listed page by page."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from connectors.base import SourceError, SourceItem, is_hidden, is_sidecar, parse_sidecar

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

    Credentials come from boto3's standard chain (environment, profile, instance role); they are
    never stored here. The client is made on first use, so the source pickles to Ray workers.
    """

    def __init__(
        self,
        uri: str,
        endpoint_url: str | None = None,
        region: str | None = None,
        max_attempts: int = 8,
        retry_mode: str = "adaptive",
        page_size: int = 1000,
    ) -> None:
        self.bucket, self.prefix = split_s3_uri(uri)
        self.endpoint_url = endpoint_url
        self.region = region
        self.max_attempts = max_attempts
        self.retry_mode = retry_mode
        self.page_size = page_size
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
                connect_timeout=10,
                read_timeout=60,
            )
            self._client = boto3.session.Session().client(
                "s3", endpoint_url=self.endpoint_url, region_name=self.region, config=config
            )
        return self._client

    def check(self) -> None:
        try:
            listing = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, f"s3://{self.bucket}") from None
        if not listing.get("Contents"):
            raise SourceError(
                f"no objects under s3://{self.bucket}/{self.prefix}: check the prefix"
            )

    def items(self) -> Iterator[SourceItem]:
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

    def read_bytes(self, item: SourceItem) -> bytes:
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

    def _item(self, obj: dict[str, Any], sidecars: list[str]) -> SourceItem:
        questions: tuple[str, ...] = ()
        for sidecar in sidecars:
            questions += parse_sidecar(sidecar, self._get(self.bucket, sidecar))
        return SourceItem(
            uri=f"s3://{self.bucket}/{obj['Key']}",
            name=obj["Key"].rsplit("/", 1)[-1],
            size=obj.get("Size"),
            metadata={
                "etag": str(obj.get("ETag", "")).strip('"'),
                "last_modified": obj["LastModified"].isoformat() if "LastModified" in obj else None,
            },
            questions=questions,
        )

    def _get(self, bucket: str, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, f"s3://{bucket}/{key}") from None

    def _error(self, error: Exception, where: str) -> SourceError:
        """One line that says what went wrong and what to do, without any secret."""
        endpoint = f" at {self.endpoint_url}" if self.endpoint_url else ""
        if isinstance(error, NoCredentialsError):
            return SourceError(
                f"no AWS credentials found for {where}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
            )
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
        return SourceError(f"cannot reach S3 for {where}{endpoint}: {error}")
