"""The Ray Serve endpoint (`memstream serve`).

The first tests need nothing running: configuration, URI policy, API keys, and the refusal to
listen on a public address without keys. The `engine` tests start the real application once for
the module (`python -m serving.cli serve`: a private Ray instance, Serve, the real vLLM engine on
the small test model, a SQLite job store, a real S3 server for URIs) and talk to it over HTTP;
the last one restarts it in the middle of a job.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

import serving.api
from connectors.engines.fake import FactEngine, WordTokenizer
from connectors.processes import ServerNotReady, ServerProcess, free_port, http_ok
from connectors.state.jobs import JobConflict, job_chain_key
from connectors.state.records import NewJob, StepCheckpoint
from connectors.state.store import StateStore
from operators.config import ConfigError, MethodConfig
from operators.core.chain import ChainStatus, StepRecord
from operators.core.evidence import Evidence, Grounding
from serving.answering import DocumentPreparer, SyncAnswerer
from serving.api import ApiServices, KeyCheck, build_api
from serving.config import (
    JobsConfig,
    LimitsConfig,
    ServingConfig,
    UriConfig,
    config_from_mapping,
    load_config,
)
from serving.documents import DocumentLoader, RequestReader
from serving.jobs import JobWorker
from serving.metrics import ServingMetrics
from serving.reporting import job_report
from serving.security import ApiKeys
from serving.uris import DocumentFetcher, UriPolicy, UriRefused, redact_uri
from tests.processes import engine_cores

REPO = Path(__file__).resolve().parents[1]
API_KEY = "test-key-" + "7f3a9c2e5b8d1f4a6c0e"
BUCKET = "memstream-serving"
BAD_PDF_REASONS = {
    "broken-invalid-pages-unreadablemetadata.pdf": "damaged PDF",
    "encrypted-aes256-userpw-baz.pdf": "password required",
    "encrypted-userpw-openpassword.pdf": "password required",
    "scanned-image-only-grumman-1974.pdf": "no text layer (needs OCR)",
}
CODE_WORDS = (
    "AMBERLYNX", "BASALTFOX", "CEDARWREN", "DUNEHERON", "EMBEROTTER", "FJORDMOTH", "GRANITEELK",
    "HAZELCRANE", "IVORYBISON", "JASPERSTOAT", "KELPMARTEN", "LICHENOWL", "MAPLEIBEX",
    "NETTLEHARE", "ONYXBADGER", "PUMICETERN",
)  # fmt: skip
MIB = 1 << 20


# --- without a server --------------------------------------------------------------------------


def test_embedded_defaults_run_locally_on_loopback_with_sqlite() -> None:
    config = ServingConfig()
    assert config.server.host == "127.0.0.1"
    assert config.ray.address == "local"
    assert config.store.url.startswith("sqlite:///")
    assert not config.keys_required
    assert config.with_server("0.0.0.0", None).keys_required


def test_config_file_is_validated_with_the_key_path(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("engine: {max_model_len: 2048}\nlimits: {max_questions: 4}\n")
    config = load_config(path)
    assert config.engine.max_model_len == 2048 and config.limits.max_questions == 4
    example = load_config(REPO / "serving" / "example-config.yaml")
    assert example.engine_deployment.max_ongoing_requests == 256
    with pytest.raises(
        ConfigError, match=r"config: engine\.max_model_len: Input should be a valid int"
    ):
        config_from_mapping({"engine": {"max_model_len": "big"}})
    with pytest.raises(
        ConfigError, match=r"config: unknown key 'max_pages' in limits \(allowed: max_body"
    ):
        config_from_mapping({"limits": {"max_pages": 3}})
    with pytest.raises(ConfigError, match="num_replicas must be at least 1"):
        config_from_mapping({"engine_deployment": {"num_replicas": 0}})
    # A partial section keeps that section's own defaults (the ingress needs half a CPU).
    partial = config_from_mapping({"ingress_deployment": {"max_ongoing_requests": 64}})
    assert partial.ingress_deployment.max_ongoing_requests == 64
    assert partial.ingress_deployment.num_cpus == 0.5
    with pytest.raises(ConfigError, match="must start with http://, https:// or s3://"):
        config_from_mapping({"uris": {"allowed_prefixes": ["file:///srv/"]}})
    with pytest.raises(ConfigError, match="shorter than 16 characters"):
        config_from_mapping({"auth": {"api_keys": ["short"]}}).auth.keys()


def test_api_keys_are_kept_as_digests_and_checked() -> None:
    keys = ApiKeys.of([API_KEY], required=True)
    assert API_KEY not in repr(keys)
    assert keys.accepts(API_KEY)
    assert not keys.accepts(API_KEY + "x") and not keys.accepts("") and not keys.accepts(None)
    assert ApiKeys.of([], required=False).accepts(None)


@pytest.mark.parametrize(
    ("authorization", "status"),
    [
        (f"Bearer {API_KEY}", 200),
        (f"bearer {API_KEY}", 200),
        (None, 401),
        ("Bearer", 401),
        (f"Bearer {API_KEY}x", 401),
        (f"Basic {API_KEY}", 401),
        (API_KEY, 401),
    ],
)
def test_routes_take_the_key_as_a_bearer_token_only(authorization: str | None, status: int) -> None:
    """`KeyCheck`, the dependency every keyed route of the API has, on a route of its own."""
    app = FastAPI()
    key_check = KeyCheck(ApiKeys.of([API_KEY], required=True))

    @app.get("/keyed", dependencies=[Depends(key_check)])
    async def keyed() -> dict[str, str]:
        return {"status": "ok"}

    headers = {} if authorization is None else {"Authorization": authorization}
    response = TestClient(app).get("/keyed", headers=headers)
    assert response.status_code == status, response.text
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
        assert API_KEY not in response.text


def test_healthz_asks_the_engine_every_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = FactEngine()
    store = StateStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    store.migrate()
    try:
        with TestClient(build_api(fake_engine_services(engine, store))) as client:
            healthy = client.get("/healthz")
            engine.unhealthy = "the fake engine's process died"
            unhealthy = client.get("/healthz")
            engine.unhealthy = None
            recovered = client.get("/healthz")
            monkeypatch.setattr(serving.api, "ENGINE_HEALTH_TIMEOUT_S", 0.05)
            monkeypatch.setattr(engine, "check_health", asyncio.Event().wait)  # never answers
            silent = client.get("/healthz")
    finally:
        store.close()
    assert healthy.status_code == 200 and recovered.status_code == 200
    assert healthy.json() == {"status": "ok", "model": "fake-model", "jobs_running": 0}
    assert unhealthy.status_code == 503
    assert unhealthy.json()["status"] == "unhealthy"
    assert unhealthy.json()["reason"] == "the fake engine's process died"
    assert silent.status_code == 503
    assert silent.json()["reason"] == "the engine did not answer within 0.05 s"


def fake_engine_services(
    engine: FactEngine,
    store: StateStore,
    limits: LimitsConfig | None = None,
    uris: UriConfig | None = None,
    method: MethodConfig | None = None,
) -> ApiServices:
    """An API replica's services as `serving.app.ApiServer` builds them, with `engine` in
    place of the engine deployment and the word tokenizer in place of the model's."""
    limits, method = limits or LimitsConfig(), method or MethodConfig()
    policy = UriPolicy(uris or UriConfig())
    loader = DocumentLoader(DocumentFetcher(policy, limits.max_input_bytes), limits.document)
    preparer = DocumentPreparer(WordTokenizer(), 16384, limits.document.max_tokens)
    metrics = ServingMetrics("test-replica", store.count_jobs_by_status)
    return ApiServices(
        keys=ApiKeys.of([], required=False),
        limits=limits,
        reader=RequestReader(limits, policy),
        loader=loader,
        answerer=SyncAnswerer(engine, preparer, method, engine.model),
        engine=engine,
        store=store,
        worker=JobWorker(store, loader, preparer, engine, JobsConfig(), metrics),
        metrics=metrics,
        model=engine.model,
        method=method.as_dict(),
        poll_interval_s=0.5,
    )


@pytest.mark.parametrize(
    ("uri", "reason"),
    [
        ("/etc/passwd", "local path"),
        ("file:///etc/passwd", "local path"),
        ("ftp://example.com/x.txt", "ftp:// URI"),
        ("http://169.254.169.254/latest/meta-data", "internal address"),
        ("http://localhost:8000/v1/jobs", "internal address"),
        ("http://127.0.0.1/x", "internal address"),
        ("http://10.1.2.3/x", "internal address"),
        ("http://192.168.1.1/x", "internal address"),
        ("http://[::1]/x", "internal address"),
        ("http://[::ffff:169.254.169.254]/x", "internal address"),
        ("http://user:secret@example.com/x", "credentials"),
        ("https://example.com/docs/../admin", "'..'"),
        ("s3://other-bucket/docs/a.txt", "not under an allowed URI prefix"),
        ("s3://memstream-serving/private/a.txt", "not under an allowed URI prefix"),
    ],
)
def test_uri_policy_refuses(uri: str, reason: str) -> None:
    policy = UriPolicy(config_from_mapping(_uri_settings()).uris)
    with pytest.raises(UriRefused, match=reason.replace("(", r"\(")) as refused:
        asyncio.run(policy.check(uri))
    assert "secret" not in str(refused.value)


def test_uri_policy_allows_prefixes_and_explicit_networks() -> None:
    policy = UriPolicy(config_from_mapping(_uri_settings()).uris)
    allowed = asyncio.run(policy.check(f"s3://{BUCKET}/docs/report.pdf"))
    assert allowed.name == "report.pdf"
    opened = UriPolicy(
        config_from_mapping(
            {
                "uris": {
                    "allowed_prefixes": ["http://127.0.0.1:9/"],
                    "allowed_networks": ["127.0.0.0/8"],
                }
            }
        ).uris
    )
    assert asyncio.run(opened.check("http://127.0.0.1:9/a.txt")).addresses == ("127.0.0.1",)
    assert redact_uri("https://u:p@host/a.pdf?X-Amz-Signature=abc#f") == "https://host/a.pdf"


def _uri_settings() -> dict[str, Any]:
    return {"uris": {"allowed_prefixes": ["http://", "https://", f"s3://{BUCKET}/docs/"]}}


def test_refuses_to_listen_beyond_loopback_without_keys(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MEMSTREAM_API_KEYS"}
    run = _serve_command("--host", "0.0.0.0", "--port", str(free_port()), env=env)
    assert run.returncode == 2
    assert "refusing to start without API keys: 0.0.0.0 is not a loopback address" in run.stderr
    shown = _serve_command("--print-config", env={**env, "MEMSTREAM_API_KEYS": API_KEY})
    assert shown.returncode == 0 and API_KEY not in shown.stdout
    assert yaml.safe_load(shown.stdout)["server"]["host"] == "127.0.0.1"


def _serve_command(*arguments: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "serving.cli", "serve", *arguments],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgres", marks=pytest.mark.server)])
def test_job_store_leases_checkpoints_and_events(
    database: str, request: pytest.FixtureRequest
) -> None:
    store = StateStore(request.getfixturevalue(f"{database}_url"))
    store.migrate()
    new = NewJob("a.txt", "upload:a.txt", ("q1", "q2"), {"chunk_size": 300}, data=b"hello")
    job_id = store.create_job(new)
    assert job_id in store.claim_jobs("replica-1", 30, 100)
    assert job_id not in store.claim_jobs("replica-2", 30, 100)  # leased to replica 1
    document = {"name": "a.txt", "parser": "text", "n_tokens": 9, "n_segments": 2}
    assert store.save_job_document(job_id, "replica-1", "hello", document, new.questions)
    record = StepRecord(
        job_chain_key(job_id, 0), 0, "update", 0, 0, 5, 0, 20, "memory one", 10, 2, "stop", 0.1
    )
    step = StepCheckpoint(record, 1, "memory one", done=False, answer=None, raw_response=None)
    assert store.record_job_step(job_id, "replica-1", 0, step)
    assert not store.record_job_step(job_id, "replica-2", 0, step)  # only the lease holder writes
    evidence = Evidence(0, None, 0, 5, "hello", 100.0, "answer")
    grounding = Grounding((evidence,), grounded=True, reason="Found in segment 0.")
    assert store.record_job_grounding(job_id, "replica-1", 0, grounding)
    assert not store.record_job_grounding(job_id, "replica-2", 0, grounding)
    state = store.get_job(job_id)
    assert state is not None
    assert state.chains[0].answer_record()["evidence"] == [evidence.as_dict()]
    assert (state.chains[0].grounded, state.chains[1].grounded) == (True, None)
    trajectory = store.job_trajectory(state)
    assert [(row["question_id"], row["step"], row["memory_after"]) for row in trajectory] == [
        ("q0", 0, "memory one")
    ]
    page = job_report(state, trajectory, "a-model")
    assert "memory one" in page and "grounded" in page and "Found in segment 0." in page
    store.release_jobs("replica-1", [job_id])  # e.g. a graceful shutdown
    assert job_id in store.claim_jobs("replica-2", 30, 100)
    resumed = store.load_job_input(job_id)
    assert resumed is not None and resumed.text == "hello" and resumed.data is None
    assert (resumed.chains[0].step, resumed.chains[0].memory) == (1, "memory one")
    assert (resumed.chains[0].prompt_tokens, resumed.chains[0].status) == (10, ChainStatus.RUNNING)
    assert resumed.chains[0].answer_record()["status"] == "pending"  # as the API shows it
    assert resumed.chains[1].step == 0
    assert store.renew_leases("replica-2", [job_id], 30) == {job_id}
    assert store.cancel_job(job_id)
    assert not store.record_job_step(job_id, "replica-2", 0, step)
    assert store.renew_leases("replica-2", [job_id], 30) == set()
    with pytest.raises(JobConflict):
        store.cancel_job(job_id)
    assert [event.kind for event in store.events_after(job_id, 0)] == ["memory", "end"]
    assert store.events_after(job_id, 0)[-1].data["status"] == "cancelled"
    stalled = store.create_job(new)
    assert stalled in store.claim_jobs("replica-3", -1, 100)  # its lease has already run out
    assert stalled in store.claim_jobs("replica-4", 30, 100)
    assert store.finish_job(stalled, "replica-4", "failed", "cannot read a.txt: empty document")
    state = store.get_job(stalled)
    assert state is not None and state.status == "failed" and state.finished
    assert store.get_job("0" * 32) is None
    store.close()


# --- the real application ----------------------------------------------------------------------


@dataclass
class ServeApp:
    """`python -m serving.cli serve` in its own session, stopped with SIGTERM by its PID."""

    folder: Path
    ray_dir: Path
    config_path: Path
    env: dict[str, str]
    url: str
    server: ServerProcess | None = None
    starts: int = 0
    startup_s: float = 0.0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=600)

    def start(self, timeout: float = 900) -> None:
        self.starts += 1
        command = [sys.executable, "-m", "serving.cli", "serve", "--config", str(self.config_path)]
        log = self.folder / f"serve-{self.starts}.log"
        self.server = ServerProcess(command, log, env=self.env, cwd=REPO)
        try:
            self.startup_s = self.server.wait_until(
                http_ok(f"{self.url}/healthz"), "memstream serve", timeout
            )
        except ServerNotReady as error:
            pytest.fail(str(error))

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=180)
        self.server = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def logs(self) -> str:
        texts = [path.read_text(errors="replace") for path in self.folder.glob("serve-*.log")]
        for path in self.ray_dir.rglob("*"):
            if path.is_file() and path.suffix in (".log", ".out", ".err"):
                texts.append(path.read_text(errors="replace"))
        return "\n".join(texts)


@pytest.fixture(scope="module")
def app(
    tmp_path_factory: pytest.TempPathFactory, test_model_path: str, s3_server
) -> Iterator[ServeApp]:  # type: ignore[no-untyped-def]
    with serve_app(tmp_path_factory, test_model_path, s3_server) as served:
        yield served


@contextmanager
def serve_app(
    tmp_path_factory: pytest.TempPathFactory, test_model_path: str, s3_server
) -> Iterator[ServeApp]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("serving")
    # Ray's socket paths must stay short, so its folder is not under pytest's deep tmp path.
    ray_dir = Path(tempfile.mkdtemp(prefix="msray-", dir="/tmp"))
    client = s3_server.client()
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):  # the module's app made it
        client.create_bucket(Bucket=BUCKET)
    client.put_object(
        Bucket=BUCKET, Key="docs/note.txt", Body=b"Shipping note. The pallet code is QUARTZMOLE."
    )
    port = free_port()
    settings = {
        "server": {"host": "127.0.0.1", "port": port},
        "ray": {"num_cpus": 2, "object_store_memory_mib": 256},
        "engine": {
            "model": test_model_path,
            "max_model_len": 2048,
            "cpu_kvcache_space_gib": 1,
            "enforce_eager": True,
        },
        # Serve replaces an engine replica three failed checks after its engine died.
        "engine_deployment": {"health_check_period_s": 1.0},
        "method": {"chunk_size": 300, "max_memory_tokens": 24, "max_answer_tokens": 24},
        "store": {"url": f"sqlite:///{folder / 'serving.db'}"},
        "limits": {"max_body_bytes": 4 * MIB, "max_input_bytes": 3 * MIB + MIB // 2},
        "uris": {
            "allowed_prefixes": ["http://", "https://", f"s3://{BUCKET}/docs/"],
            "s3_endpoint_url": s3_server.endpoint_url,
        },
        "jobs": {"lease_s": 6.0, "poll_interval_s": 0.25},
        "auth": {"require_keys": True},
    }
    config_path = folder / "serve.yaml"
    config_path.write_text(yaml.safe_dump(settings))
    env = {
        **os.environ,
        "MEMSTREAM_API_KEYS": API_KEY,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_TMPDIR": str(ray_dir),
    }
    env.pop("RAY_ADDRESS", None)
    served = ServeApp(folder, ray_dir, config_path, env, f"http://127.0.0.1:{port}")
    try:
        served.start()
        print(f"\nserve start-up: {served.startup_s:.0f} s")
        yield served
    finally:
        served.stop()
        shutil.rmtree(ray_dir, ignore_errors=True)


@pytest.mark.engine
def test_health_docs_and_metrics(app: ServeApp) -> None:
    health = httpx.get(f"{app.url}/healthz").json()
    assert health["status"] == "ok" and "reason" not in health
    paths = httpx.get(f"{app.url}/openapi.json").json()["paths"]
    assert {"/v1/answer", "/v1/jobs", "/v1/jobs/{job_id}/events", "/metrics"} <= set(paths)
    body = paths["/v1/answer"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(body)
    assert httpx.get(f"{app.url}/metrics").status_code == 401
    with app.client() as client:
        metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert 'memstream_jobs{status="queued"}' in metrics.text


@pytest.mark.engine
@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong-key-000000000000", f"Basic {API_KEY}", "Bearer"]
)
def test_missing_or_invalid_key_is_refused(app: ServeApp, authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization is not None else {}
    for method, path in [
        ("POST", "/v1/answer"),
        ("POST", "/v1/jobs"),
        ("GET", f"/v1/jobs/{'0' * 32}"),
        ("GET", f"/v1/jobs/{'0' * 32}/report"),
    ]:
        response = httpx.request(
            method, f"{app.url}{path}", json={"text": "x", "questions": ["q"]}, headers=headers
        )
        assert response.status_code == 401, (method, path, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        assert API_KEY not in response.text


@pytest.mark.engine
def test_sync_answer_from_json_text_and_from_an_upload(app: ServeApp) -> None:
    document = _document("TOPAZWALRUS", segments=2)
    questions = ["What is the code word?", "Who wrote the log?"]
    with app.client() as client:
        response = client.post("/v1/answer", json={"text": document, "questions": questions})
        uploaded = client.post(
            "/v1/answer",
            files={"file": ("notes.md", _document("ZIRCONLEMUR", 1).encode(), "text/markdown")},
            data={"questions": ["What is the code word?"]},
        )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "succeeded"
    assert body["document"]["n_segments"] >= 2 and body["document"]["parser"] == "text"
    assert [answer["question"] for answer in body["answers"]] == questions
    for answer in body["answers"]:
        assert answer["status"] == "ok" and answer["final_memory"] and answer["raw_response"]
        assert answer["n_segments"] == body["document"]["n_segments"]
        assert answer["prompt_tokens"] > 0 and answer["completion_tokens"] > 0
        assert isinstance(answer["grounded"], bool) and answer["grounding_reason"]
        for item in answer["evidence"]:
            assert document[item["char_start"] : item["char_end"]] == item["quote"]
    assert body["usage"]["prompt_tokens"] == sum(a["prompt_tokens"] for a in body["answers"])
    assert set(body["timings"]) == {"read_s", "prepare_s", "chains_s", "total_s"}
    assert uploaded.status_code == 200, uploaded.text
    assert uploaded.json()["document"]["name"] == "notes.md"
    assert uploaded.json()["document"]["parser"] == "markdown"


@pytest.mark.engine
def test_job_lifecycle_with_progress_events_and_result(app: ServeApp) -> None:
    questions = ["What is the code word?", "What is archived?"]
    with app.client() as client:
        created = client.post(
            "/v1/jobs", json={"text": _document("OPALGECKO", 3), "questions": questions}
        )
        assert created.status_code == 202, created.text
        job_id = created.json()["job_id"]
        assert created.json()["links"]["events"] == f"/v1/jobs/{job_id}/events"
        events = _read_events(client, job_id)
        status = client.get(f"/v1/jobs/{job_id}").json()
        result = client.get(f"/v1/jobs/{job_id}/result")
    n_segments = status["document"]["n_segments"]
    assert n_segments >= 3
    memory_events = [data for kind, data in events if kind == "memory"]
    assert len(memory_events) == n_segments * len(questions)
    for index in range(len(questions)):
        steps = [e["segments_done"] for e in memory_events if e["question_index"] == index]
        assert steps == list(range(1, n_segments + 1))
    assert [kind for kind, _ in events].count("end") == 1 and events[-1][0] == "end"
    assert events[-1][1]["status"] == "succeeded"
    assert status["status"] == "succeeded"
    assert [p["segments_done"] for p in status["progress"]] == [n_segments, n_segments]
    assert result.status_code == 200, result.text
    answers = result.json()["answers"]
    assert [answer["question"] for answer in answers] == questions
    for answer, final in zip(answers, events[-1][1]["answers"], strict=True):
        assert answer["status"] == "ok" and answer["raw_response"]
        assert answer["answer"] == final["answer"]
    last_memory = {e["question_index"]: e["memory"] for e in memory_events}
    assert [answer["final_memory"] for answer in answers] == [last_memory[0], last_memory[1]]
    for answer in answers:  # every answered chain's evidence was looked up
        assert isinstance(answer["grounded"], bool) and answer["grounding_reason"]
        for item in answer["evidence"]:
            assert item["quote"] and item["char_end"] > item["char_start"]
    with app.client() as client:
        report = client.get(f"/v1/jobs/{job_id}/report")
    assert report.status_code == 200, report.text
    assert "default-src 'none'" in report.headers["content-security-policy"]
    assert all(html.escape(question) in report.text for question in questions)
    assert httpx.get(f"{app.url}/v1/jobs/{job_id}/report").status_code == 401  # the job's key


@pytest.mark.engine
def test_cancel_a_running_job(app: ServeApp) -> None:
    with app.client() as client:
        job_id = client.post(
            "/v1/jobs", json={"text": _document("RUBYMANTIS", 24), "questions": ["Code word?"]}
        ).json()["job_id"]
        _wait_for(lambda: _segments_done(client, job_id) >= 1, "the first memory update")
        cancelled = client.delete(f"/v1/jobs/{job_id}")
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
        done_at_cancel = _segments_done(client, job_id)
        events = _read_events(client, job_id)
        assert events[-1][0] == "end" and events[-1][1]["status"] == "cancelled"
        time.sleep(3)
        status = client.get(f"/v1/jobs/{job_id}").json()
        assert status["status"] == "cancelled"
        assert status["progress"][0]["segments_done"] == done_at_cancel < 24
        assert client.get(f"/v1/jobs/{job_id}/result").status_code == 409
        assert client.delete(f"/v1/jobs/{job_id}").status_code == 409
        assert client.get(f"/v1/jobs/{'f' * 32}").status_code == 404


@pytest.mark.engine
def test_oversized_bodies_get_413(app: ServeApp) -> None:
    with app.client() as client:
        declared = client.post(
            "/v1/answer",
            content=b"x" * (5 * MIB),
            headers={"Content-Type": "application/json"},
        )
        chunked = client.post(
            "/v1/jobs",
            content=(b"y" * MIB for _ in range(5)),
            headers={"Content-Type": "application/json"},
        )
        document = client.post(
            "/v1/answer", json={"text": "z" * (3 * MIB + MIB // 2 + 1), "questions": ["q"]}
        )
    assert declared.status_code == 413 and "4,194,304 bytes" in declared.json()["detail"]
    assert chunked.status_code == 413, chunked.text
    assert document.status_code == 413 and "input limit" in document.json()["detail"]


@pytest.mark.engine
def test_invalid_input_gets_422_with_a_human_message(app: ServeApp) -> None:
    cases = [
        ({"text": "doc"}, "questions: Field required"),
        ({"text": "doc", "questions": []}, "questions"),
        ({"questions": ["q"]}, "exactly one of 'text' or 'uri'"),
        ({"text": "doc", "uri": "https://example.com/a", "questions": ["q"]}, "exactly one"),
        ({"text": "doc", "questions": ["q"], "colour": "red"}, "colour: unknown field"),
        ({"text": "doc", "questions": ["q"] * 17}, "at most 16"),
    ]
    with app.client() as client:
        for body, message in cases:
            response = client.post("/v1/answer", json=body)
            assert response.status_code == 422, (body, response.text)
            assert message in response.json()["detail"]
        plain = client.post("/v1/answer", content=b"hello", headers={"Content-Type": "text/plain"})
        assert plain.status_code == 415


@pytest.mark.engine
@pytest.mark.parametrize(
    "uri",
    [
        "/etc/passwd",
        "file:///etc/passwd",
        "http://169.254.169.254/latest/meta-data",
        "http://localhost:{port}/v1/jobs",
        "http://127.0.0.1:{port}/healthz",
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://admin:hunter2-secret@example.com/doc.txt",
        f"s3://{BUCKET}/private/secret.txt",
    ],
)
def test_forbidden_uris_are_refused(app: ServeApp, uri: str) -> None:
    uri = uri.format(port=app.url.rsplit(":", 1)[1])
    with app.client() as client:
        answer = client.post("/v1/answer", json={"uri": uri, "questions": ["What?"]})
        job = client.post("/v1/jobs", json={"uri": uri, "questions": ["What?"]})
    for response in (answer, job):
        assert response.status_code == 422, response.text
        assert response.json()["detail"].startswith("URI refused: ")
        assert "hunter2" not in response.text


@pytest.mark.engine
def test_document_from_an_allowed_s3_uri(app: ServeApp) -> None:
    with app.client() as client:
        found = client.post(
            "/v1/answer",
            json={"uri": f"s3://{BUCKET}/docs/note.txt", "questions": ["What is the pallet code?"]},
        )
        missing = client.post(
            "/v1/answer", json={"uri": f"s3://{BUCKET}/docs/missing.txt", "questions": ["What?"]}
        )
        job_id = client.post(
            "/v1/jobs", json={"uri": f"s3://{BUCKET}/docs/note.txt", "questions": ["Code?"]}
        ).json()["job_id"]
        _read_events(client, job_id)
        job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["source"] == f"s3://{BUCKET}/docs/note.txt"
    assert found.status_code == 200, found.text
    assert found.json()["document"]["name"] == "note.txt"
    assert missing.status_code == 422 and "does not exist" in missing.json()["detail"]


@pytest.mark.engine
def test_bad_pdfs_are_refused_with_the_reason(app: ServeApp, corpora: Path) -> None:
    folder = corpora / "pdfs" / "bad"
    with app.client() as client:
        job_ids = {}
        for name, reason in BAD_PDF_REASONS.items():
            upload = {"file": (name, (folder / name).read_bytes(), "application/pdf")}
            response = client.post("/v1/answer", files=upload, data={"questions": ["What?"]})
            assert response.status_code == 422, (name, response.text)
            assert response.json()["detail"].startswith(f"cannot read {name}: {reason}")
            queued = client.post("/v1/jobs", files=upload, data={"questions": ["What?"]})
            assert queued.status_code == 202
            job_ids[name] = queued.json()["job_id"]
        for name, job_id in job_ids.items():
            _wait_for(
                lambda job_id=job_id: client.get(f"/v1/jobs/{job_id}").json()["status"] == "failed",
                f"job of {name} to fail",
            )
            status = client.get(f"/v1/jobs/{job_id}").json()
            assert BAD_PDF_REASONS[name] in status["error"]
            assert status["progress"] == []
            events = _read_events(client, job_id)
            assert [kind for kind, _ in events] == ["end"] and events[0][1]["status"] == "failed"
        # A PDF with a damaged cross-reference table is repaired by the parser and answered.
        recovered = client.post(
            "/v1/answer",
            files={"file": ("zen.pdf", (folder / "corrupted-zen_of_python.pdf").read_bytes())},
            data={"questions": ["What is better than ugly?"]},
        )
    assert recovered.status_code == 200, recovered.text
    assert recovered.json()["document"]["parser"].startswith("pdf")


@pytest.mark.engine
def test_sixteen_concurrent_clients_each_get_their_own_answer(app: ServeApp) -> None:
    async def ask(client: httpx.AsyncClient, index: int, word: str) -> tuple[int, str, Any]:
        text = f"Record {index}. The code word of record {index} is {word}. Keep {word} safe."
        question = f"What is the code word of record {index}?"
        response = await client.post("/v1/answer", json={"text": text, "questions": [question]})
        return index, question, response

    async def everyone() -> list[tuple[int, str, Any]]:
        async with httpx.AsyncClient(base_url=app.url, headers=app.headers, timeout=900) as client:
            return await asyncio.gather(*(ask(client, i, w) for i, w in enumerate(CODE_WORDS)))

    started = time.monotonic()
    results = asyncio.run(everyone())
    elapsed = time.monotonic() - started
    print(f"\n16 concurrent answers in {elapsed:.1f} s")
    for index, question, response in results:
        assert response.status_code == 200, response.text
        body = response.json()
        (answer,) = body["answers"]
        assert answer["question"] == question and answer["status"] == "ok"
        assert body["document"]["n_segments"] == 1 and answer["prompt_tokens"] > 0
        others = [word for i, word in enumerate(CODE_WORDS) if i != index]
        produced = f"{answer['final_memory']} {answer['raw_response']}"
        assert not [word for word in others if word in produced], (index, produced)


@pytest.mark.engine
def test_serve_replaces_an_engine_replica_whose_engine_core_died_and_queued_jobs_finish(
    app: ServeApp,
) -> None:
    assert app.server is not None
    serve_processes = psutil.Process(app.server.process.pid)
    # /healthz answered 200 at start-up; the engine core may still be finishing its start
    try:
        _wait_for(lambda: len(engine_cores(serve_processes)) == 1, "one live engine core", 120)
    except AssertionError:
        seen = _commands(serve_processes)
        raise AssertionError(f"no one live engine core among {seen}") from None
    (killed,) = engine_cores(serve_processes)
    with app.client() as client:
        queued = client.post(
            "/v1/jobs", json={"text": _document("AMBERHERON", 8), "questions": ["Code word?"]}
        ).json()["job_id"]
    os.kill(killed.pid, signal.SIGKILL)
    started = time.monotonic()
    unhealthy = _health_when(app, 503, timeout=60)
    reported_s = time.monotonic() - started
    _health_when(app, 200, timeout=600)
    replaced_s = time.monotonic() - started
    print(f"\n/healthz 503 after {reported_s:.1f} s, 200 again after {replaced_s:.0f} s")
    assert unhealthy["status"] == "unhealthy" and "EngineCore is dead" in unhealthy["reason"]
    (replacement,) = engine_cores(serve_processes)
    assert replacement.pid != killed.pid
    with app.client() as client:
        response = client.post(
            "/v1/answer", json={"text": _document("TOPAZWALRUS", 1), "questions": ["Code word?"]}
        )
        events = _read_events(client, queued)  # resumed once its lease ran out
        status = client.get(f"/v1/jobs/{queued}").json()
    assert response.status_code == 200, response.text
    assert response.json()["answers"][0]["status"] == "ok"
    assert events[-1][0] == "end" and status["status"] == "succeeded", status
    steps = [data["segments_done"] for kind, data in events if kind == "memory"]
    assert steps[-1] == status["document"]["n_segments"], steps


@pytest.mark.engine
def test_restart_resumes_an_unfinished_job_and_keeps_finished_ones(app: ServeApp) -> None:
    with app.client() as client:
        finished = client.post(
            "/v1/jobs", json={"text": _document("SLATEPUFFIN", 1), "questions": ["Code word?"]}
        ).json()["job_id"]
        _read_events(client, finished)
        before = client.get(f"/v1/jobs/{finished}/result").json()
        job_id = client.post(
            "/v1/jobs", json={"text": _document("COBALTYAK", 10), "questions": ["Code word?"]}
        ).json()["job_id"]
        _wait_for(lambda: _segments_done(client, job_id) >= 2, "two memory updates")
    app.restart()
    print(f"\nserve restart: {app.startup_s:.0f} s")
    with app.client() as client:
        resumed_at = _segments_done(client, job_id)
        assert resumed_at >= 2  # the checkpoint survived; the job did not start over
        events = _read_events(client, job_id)
        status = client.get(f"/v1/jobs/{job_id}").json()
        result = client.get(f"/v1/jobs/{job_id}/result")
        assert client.get(f"/v1/jobs/{finished}/result").json() == before
    assert status["status"] == "succeeded", status
    assert result.status_code == 200
    n_segments = status["document"]["n_segments"]
    steps = [data["segments_done"] for kind, data in events if kind == "memory"]
    assert steps == list(range(1, n_segments + 1))  # one event per step, none repeated
    assert [kind for kind, _ in events].count("end") == 1
    assert len(result.json()["answers"]) == 1 and result.json()["answers"][0]["status"] == "ok"
    logs = app.logs()
    assert API_KEY not in logs and "hunter2" not in logs


# --- helpers -----------------------------------------------------------------------------------


def _document(code_word: str, segments: int) -> str:
    """About `segments` segments of 300 tokens, the code word in the middle."""
    lines = [
        f"Entry {i}: the archive keeps ledger page {i} with routine shipping figures."
        for i in range(22 * segments)
    ]
    lines.insert(len(lines) // 2, f"The code word is {code_word}.")
    return "\n".join(lines)


def _read_events(client: httpx.Client, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    kind = ""
    with client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((kind, json.loads(line.removeprefix("data: "))))
    return events


def _health_when(app: ServeApp, status: int, timeout: float) -> dict[str, Any]:
    """The body of the first /healthz response with `status`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = httpx.get(f"{app.url}/healthz", timeout=10)
        if response.status_code == status:
            return response.json()
        time.sleep(0.25)
    raise AssertionError(f"/healthz did not answer {status} within {timeout:.0f} s")


def _commands(root: psutil.Process) -> list[str]:
    """The command lines of `root`'s live descendants, shortened: what a failure shows."""
    commands = []
    for child in root.children(recursive=True):
        with contextlib.suppress(psutil.Error):  # it exited while we looked
            commands.append(" ".join(child.cmdline())[:80])
    return commands


def _segments_done(client: httpx.Client, job_id: str) -> int:
    progress = client.get(f"/v1/jobs/{job_id}").json()["progress"]
    return min((item["segments_done"] for item in progress), default=0)


def _wait_for(condition: Any, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")
