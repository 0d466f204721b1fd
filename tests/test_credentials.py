"""No secret of a job in anything it leaves behind (issue 18, item 5).

Real jobs (`run_job`, Ray Data, the Parquet export, and `memstream run`) read their documents
from the SeaweedFS S3 server with its secret key (AWS_* variables, as a user gives them), keep
their state in the session's PostgreSQL as a role of their own whose password is in the store's
URL, and ask the fact engine behind an OpenAI-compatible server (tests/chat_server.py) that
requires an API key ($OPENAI_API_KEY). Each secret is random and distinctive. After a run that
works, runs that fail on each credential, and a run whose key is revoked in the middle, every
file under the job's output folder (the log of `memstream run`, the manifest, the Parquet files
as bytes and as rows), the summary, the error messages, what reached stdout, stderr and the log
records, and every file of the Ray session are searched for every secret, as it is, URL-encoded,
and by its random part alone: none may be there.

The runs must also have used the credentials (documents read from S3, the run recorded in the
role's database, answers from the server that saw the key), so the search cannot pass by having
nothing to find. The server answers a refused key with a 401 that repeats the key, as some do:
an adapter that relayed the server's words would leak it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
import yaml

from connectors.engines.fake import FACT
from connectors.processes import free_port
from connectors.seaweedfs import S3Server
from pipeline.cli.flags import EXIT_PARTIAL_FAILURE
from pipeline.job import JobError, JobSpec, run_job
from tests.chat_server import FactChatServer, JsonHandler, fact_job_fields
from tests.services import PostgresServer, require_credential_checks

pytestmark = pytest.mark.server


@dataclass(frozen=True)
class Secret:
    name: str
    value: str
    random_part: str  # found whatever the encoding around it

    @classmethod
    def made(cls, name: str, prefix: str) -> Secret:
        random_part = secrets.token_hex(16)
        return cls(name, prefix + random_part, random_part)

    @property
    def forms(self) -> set[str]:
        """As it is, URL-encoded, and its random part alone."""
        return {self.value, quote(self.value, safe=""), self.random_part}


@dataclass(frozen=True)
class Credentials:
    s3: S3Server
    s3_secret: Secret
    api_key: Secret
    database_password: Secret
    database: str  # the role's name and its database's
    postgres_port: int

    def store_url(self, password: str) -> str:
        """The state store's URL, the password URL-encoded as a user must write it."""
        return (
            f"postgresql+psycopg://{self.database}:{quote(password, safe='')}"
            f"@127.0.0.1:{self.postgres_port}/{self.database}"
        )

    @property
    def state_store(self) -> str:
        return self.store_url(self.database_password.value)

    @property
    def shown_state_store(self) -> str:
        """The state store's URL as memstream may show it."""
        return self.store_url("PASSWORD").replace(":PASSWORD@", ":***@")

    @property
    def all(self) -> list[Secret]:
        return [self.s3_secret, self.api_key, self.database_password]


@pytest.fixture(scope="module")
def credentials(s3_server: S3Server, postgres_server: PostgresServer) -> Iterator[Credentials]:
    """The S3 server's secret key (in AWS_* while s3_server lives), a PostgreSQL role and
    database of their own with a password that needs URL-encoding (@ and /), and an API key
    in $OPENAI_API_KEY for the module."""
    password = Secret.made("PostgreSQL password", "pg@memstream/")
    database = f"creds_{secrets.token_hex(4)}"
    admin = sa.create_engine(postgres_server.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f"CREATE ROLE {database} LOGIN PASSWORD '{password.value}'")
        connection.exec_driver_sql(f"CREATE DATABASE {database} OWNER {database}")
    admin.dispose()
    api_key = Secret.made("OpenAI API key", "sk-memstream-test-")
    s3_secret = Secret("S3 secret key", s3_server.secret_key, s3_server.secret_key)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OPENAI_API_KEY", api_key.value)
        yield Credentials(s3_server, s3_secret, api_key, password, database, postgres_server.port)


@pytest.fixture(scope="module")
def ray_session(credentials: Credentials) -> Iterator[Path]:
    """A Ray session whose workers have the credentials in their environment (started after
    they are set), its files in a folder of this module's: returns the folder. As
    tests.conftest.local_ray, but with Ray's temp folder short (Ray's socket paths must fit in
    107 bytes) and our own."""
    import ray

    folder = Path(tempfile.mkdtemp(prefix="ms-ray-"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_worker_niceness", "0")
        ray.init(
            num_cpus=4, include_dashboard=False, logging_level="WARNING", _temp_dir=str(folder)
        )
    try:
        yield folder
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


class KeyedChatServer(FactChatServer):
    """The fact chat server behind an API key. A request without `Authorization: Bearer <key>`
    gets a 401 whose message repeats the key it was sent; after `revoke_after(n)`, every
    request after the n-th chat request is refused so (a key revoked in the middle of a run)."""

    def __init__(self, api_key: str) -> None:
        super().__init__()
        self.api_key = api_key
        self.revoked = False
        self.keys_seen: set[str] = set()
        self.refused = 0

    def revoke_after(self, chat_requests: int) -> None:
        def revoke(number: int) -> None:
            if number >= chat_requests:
                self.revoked = True

        self.before_reply = revoke

    def _handler(self) -> type[JsonHandler]:
        owner, base = self, super()._handler()

        class Handler(base):  # type: ignore[valid-type,misc]
            def authorized(self) -> bool:
                presented = self.headers.get("Authorization", "").removeprefix("Bearer ")
                owner.keys_seen.add(presented)
                if presented == owner.api_key and not owner.revoked:
                    return True
                with owner._lock:
                    owner.refused += 1
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                error = {
                    "message": f"Incorrect API key provided: {presented}",
                    "type": "invalid_request_error",
                    "code": "invalid_api_key",
                }
                self.reply(401, json.dumps({"error": error}).encode())
                return False

            def do_GET(self) -> None:
                if self.authorized():
                    super().do_GET()

            def do_POST(self) -> None:
                if self.authorized():
                    super().do_POST()

        return Handler


@pytest.fixture
def chat_server(credentials: Credentials) -> Iterator[KeyedChatServer]:
    with KeyedChatServer(credentials.api_key.value) as server:
        yield server


def s3_reports(s3: S3Server) -> tuple[dict[str, Any], dict[str, set[str]]]:
    """Two reports under a new bucket, their facts new to the state store (so every run asks
    the server): the S3 source that reads them, and each report's facts."""
    tag = secrets.token_hex(4)
    bucket = f"creds-{tag}"
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    facts = {}
    for index in range(2):
        name = f"report-{index}.txt"
        names = [f"fact-{tag}r{index}l{line}" for line in range(6)]
        text = "".join(
            f"Line {k} of report {index} notes {fact} in passing.\n" for k, fact in enumerate(names)
        )
        client.put_object(Bucket=bucket, Key=f"in/{name}", Body=text.encode())
        facts[name] = set(names)
    source = {"type": "s3", "uri": f"s3://{bucket}/in/", "endpoint_url": s3.endpoint_url}
    return source, facts


def job(
    server: FactChatServer, source: dict[str, Any], output: Path, state_store: str, **engine: Any
) -> dict[str, Any]:
    """The job as a user writes it."""
    return fact_job_fields(server, [source], str(output), engine, state_store=state_store)


def files_under(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (symbolic links not followed): its bytes by its path, and a
    Parquet file's rows, every column as text."""
    found: dict[str, bytes] = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = Path(root, name)
            if path.is_symlink() or not path.is_file():
                continue
            found[str(path)] = path.read_bytes()
            if path.suffix == ".parquet":
                found[f"{path} (rows)"] = str(pq.read_table(path).to_pylist()).encode()
    return found


def as_bytes(content: str | bytes) -> bytes:
    return content if isinstance(content, bytes) else content.encode()


def assert_no_secret(places: Mapping[str, str | bytes], hidden: Sequence[Secret]) -> None:
    leaks = [
        f"{secret.name} ({form!r}) in {where}"
        for where, content in places.items()
        for secret in hidden
        for form in sorted(secret.forms)
        if form.encode() in as_bytes(content)
    ]
    assert not leaks, "secrets leaked:\n" + "\n".join(leaks)


def ray_logs(folder: Path) -> dict[str, bytes]:
    """The Ray session's files; it must hold the logs of the workers that ran the stages."""
    found = files_under(folder)
    workers = [path for path in found if "/logs/worker-" in path]
    assert workers, f"no worker logs in {folder}: {sorted(found)[:20]}"
    return found


def test_a_job_on_s3_postgres_and_a_keyed_server_leaves_no_secret_behind(
    credentials: Credentials,
    ray_session: Path,
    chat_server: KeyedChatServer,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    source, facts = s3_reports(credentials.s3)
    output = tmp_path / "out"
    spec = JobSpec.from_dict(job(chat_server, source, output, credentials.state_store))

    summary = run_job(spec, progress_interval_s=0.5)

    # It used every credential: the reports read from S3, the server's answers to the key, the
    # run kept in the role's database.
    assert summary.ok and summary.chains_done == len(facts)
    answers = pq.read_table(summary.outputs["answers"]).to_pandas()
    assert set(answers.source_uri) == {f"{source['uri']}{name}" for name in facts}
    for row in answers.itertuples():
        assert set(FACT.findall(row.answer)) == facts[row.name], row.answer
    assert chat_server.keys_seen == {credentials.api_key.value} and chat_server.refused == 0
    assert chat_server.answered >= summary.chains_done
    store = sa.create_engine(credentials.state_store)
    with store.connect() as connection:
        recorded = connection.execute(
            sa.text("SELECT status FROM runs WHERE run_id = :run_id"), {"run_id": summary.run_id}
        ).scalar_one()
    store.dispose()
    assert recorded == "done"

    stdout, stderr = capfd.readouterr()
    outputs = files_under(output)
    assert {Path(path).name for path in outputs} >= {"answers.parquet", "manifest.json"}
    # the search reads the answers' rows: it finds a fact there
    assert min(facts["report-0.txt"]).encode() in outputs[f"{summary.outputs['answers']} (rows)"]
    assert_no_secret(
        {
            "the summary": f"{summary!r} {summary}",
            "stdout": stdout,
            "stderr": stderr,
            "the log records": caplog.text,
            **outputs,
            **ray_logs(ray_session),
        },
        credentials.all,
    )
    assert summary.state_store == credentials.shown_state_store


@pytest.mark.parametrize(
    "fault", ["wrong S3 secret", "wrong database password", "wrong API key", "engine port closed"]
)
def test_a_job_that_fails_on_a_credential_says_so_without_any_secret(
    fault: str,
    credentials: Credentials,
    chat_server: KeyedChatServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each fails while the job is checked, before Ray: in the driver, whose environment the
    test can change."""
    caplog.set_level(logging.DEBUG)
    source, _ = s3_reports(credentials.s3)
    wrong = Secret.made(fault, "wrong-memstream-")
    state_store, engine = credentials.state_store, {}
    if fault == "wrong S3 secret":
        require_credential_checks(credentials.s3)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong.value)
        expected = "access denied to s3://"
    elif fault == "wrong database password":
        state_store = credentials.store_url(wrong.value)
        expected = "password authentication failed"
    elif fault == "wrong API key":
        monkeypatch.setenv("OPENAI_API_KEY", wrong.value)
        expected = "rejected the API key"
    else:
        engine = {"base_url": f"http://127.0.0.1:{free_port()}/v1"}
        expected = "cannot reach http://127.0.0.1"
    output = tmp_path / "out"
    spec = JobSpec.from_dict(job(chat_server, source, output, state_store, **engine))

    with pytest.raises(JobError) as failure:
        run_job(spec)

    message = str(failure.value)
    assert expected in message and "\n" not in message, message
    if fault == "wrong database password":  # refused at once, not waited for as a restart
        assert "unreachable, retrying" not in caplog.text
    if fault == "wrong API key":  # the server saw the key, and its 401 repeated it
        assert chat_server.keys_seen == {wrong.value} and chat_server.refused > 0
    stdout, stderr = capfd.readouterr()
    assert_no_secret(
        {
            "the JobError": f"{failure.value!r} {message}",
            "stdout": stdout,
            "stderr": stderr,
            "the log records": caplog.text,
            **files_under(output),
        },
        [*credentials.all, wrong],
    )


def test_memstream_run_whose_key_is_revoked_mid_run_logs_no_secret(
    credentials: Credentials, ray_session: Path, chat_server: KeyedChatServer, tmp_path: Path
) -> None:
    """`memstream run` as a user runs it, from a job file, on the module's Ray session: its log
    file (under the output folder) gets what Ray and the workers print, and the failed chains
    are listed on the terminal."""
    import ray

    source, facts = s3_reports(credentials.s3)
    output = tmp_path / "out"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job(chat_server, source, output, credentials.state_store)))
    chat_server.revoke_after(3)
    address = ray.get_runtime_context().gcs_address

    command = [sys.executable, "-m", "pipeline.cli.main", "run", str(job_file)]
    result = subprocess.run(
        [*command, "--ray-address", address],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )

    assert result.returncode == EXIT_PARTIAL_FAILURE, result.stderr[-3000:]
    # the key was used, then refused with a 401 that repeated it
    assert chat_server.answered >= 3 and chat_server.refused > 0
    assert chat_server.keys_seen == {credentials.api_key.value}
    (answers_file,) = output.glob("*/answers.parquet")
    answers = pq.read_table(answers_file).to_pandas()
    assert set(answers.name) == set(facts)
    failed = answers[answers.status == "failed"]
    assert len(failed) > 0 and failed.error.str.contains("rejected the API key").all()
    assert "failed: report-" in result.stderr
    logs = list((output / "logs").glob("run-*.log"))
    assert len(logs) == 1 and str(logs[0]) in result.stderr
    assert_no_secret(
        {
            "stdout": result.stdout,
            "stderr": result.stderr,
            **files_under(output),
            **ray_logs(ray_session),
        },
        credentials.all,
    )
