"""The soak's load (bench/soak.py runs it with locust, headless): users that mix sync answers
(JSON text, an upload, an allowed URI), async jobs polled to their result, health checks and
bad requests (oversized, invalid, forbidden URIs, bad keys, hostile files, unknown jobs).

Every request names the status it expects; any other is a locust failure. Each response's
status is also counted by route, and written with locust's own latency percentiles to
$SOAK_STATS when locust quits, for bench/soak.py to check and report. Settings come from the
environment: SOAK_API_KEY, SOAK_DOCS (the allowed URI prefix of the soak's documents),
SOAK_DOCUMENTS (how many there are), SOAK_MAX_BODY_BYTES, SOAK_MAX_INPUT_BYTES, SOAK_STATS.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from locust import HttpUser, between, events, task

API_KEY = os.environ.get("SOAK_API_KEY", "")
DOCS = os.environ.get("SOAK_DOCS", "")
DOCUMENTS = int(os.environ.get("SOAK_DOCUMENTS", "1"))
MAX_BODY_BYTES = int(os.environ.get("SOAK_MAX_BODY_BYTES", str(2 << 20)))
MAX_INPUT_BYTES = int(os.environ.get("SOAK_MAX_INPUT_BYTES", str(1 << 20)))
STATS = os.environ.get("SOAK_STATS", "")
JOB_POLL_S = 1.0
JOB_TIMEOUT_S = 900.0
FINISHED = ("succeeded", "failed", "cancelled")
# Backpressure: the endpoint may shed load with 503, which counts as handled (not as a 5xx).
BACKPRESSURE = 503

statuses: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
documents = itertools.count()


@events.request.add_listener
def count_status(name: str, response: Any, exception: BaseException | None, **_: Any) -> None:
    status = getattr(response, "status_code", None) or 0  # 0: no response (connection error)
    statuses[name][int(status)] += 1


@events.quitting.add_listener
def write_stats(environment: Any, **_: Any) -> None:
    if not STATS:
        return
    routes = {}
    for (name, method), entry in sorted(environment.stats.entries.items()):
        routes[name] = {
            "method": method,
            "requests": entry.num_requests,
            "failures": entry.num_failures,
            "p50_ms": entry.get_response_time_percentile(0.5),
            "p99_ms": entry.get_response_time_percentile(0.99),
            "max_ms": entry.max_response_time,
            "statuses": {str(code): n for code, n in sorted(statuses[name].items())},
        }
    failures = [
        {"route": error.name, "error": str(error.error), "occurrences": error.occurrences}
        for error in environment.stats.errors.values()
    ]
    Path(STATS).write_text(json.dumps({"routes": routes, "failures": failures}, indent=2))


def record(index: int) -> tuple[str, str]:
    """A short document (one segment) and its question."""
    text = (
        f"Record {index}. The shipment of record {index} left the depot on time. "
        f"The code word of record {index} is WORD{index:05d}. Nothing else happened."
    )
    return text, f"What is the code word of record {index}?"


class SoakUser(HttpUser):
    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        self.client.headers["Authorization"] = f"Bearer {API_KEY}"

    def expect(self, method: str, path: str, name: str, status: int, **options: Any) -> Any:
        """One request that must answer `status` (or 503, backpressure); the response."""
        with self.client.request(
            method, path, name=name, catch_response=True, **options
        ) as response:
            if response.status_code in (status, BACKPRESSURE):
                response.success()
            else:
                response.failure(f"expected {status}, got {response.status_code}")
        return response

    # --- answered requests ---

    @task(4)
    def answer_text(self) -> None:
        text, question = record(next(documents))
        body = {"text": text, "questions": [question]}
        self.expect("POST", "/v1/answer", "POST /v1/answer (text)", 200, json=body)

    @task(1)
    def answer_upload(self) -> None:
        text, question = record(next(documents))
        self.expect(
            "POST",
            "/v1/answer",
            "POST /v1/answer (upload)",
            200,
            files={"file": ("record.md", text.encode(), "text/markdown")},
            data={"questions": [question]},
        )

    @task(1)
    def answer_uri(self) -> None:
        index = random.randrange(DOCUMENTS)
        body = {"uri": f"{DOCS}record-{index}.txt", "questions": [record(index)[1]]}
        self.expect("POST", "/v1/answer", "POST /v1/answer (uri)", 200, json=body)

    @task(2)
    def job(self) -> None:
        text, question = record(next(documents))
        created = self.expect(
            "POST", "/v1/jobs", "POST /v1/jobs", 202, json={"text": text, "questions": [question]}
        )
        if created.status_code != 202:
            return
        job_id = created.json()["job_id"]
        if self.wait_for(job_id, "succeeded"):
            self.expect("GET", f"/v1/jobs/{job_id}/result", "GET /v1/jobs/{job_id}/result", 200)

    def wait_for(self, job_id: str, expected: str) -> bool:
        """Polls the job until it finishes; the poll that sees it finish fails unless it ended
        `expected`. Whether it did."""
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            with self.client.get(
                f"/v1/jobs/{job_id}", name="GET /v1/jobs/{job_id}", catch_response=True
            ) as response:
                if response.status_code == BACKPRESSURE:
                    response.success()
                elif response.status_code != 200:
                    response.failure(f"expected 200, got {response.status_code}")
                    return False
                elif (status := response.json()["status"]) in FINISHED:
                    if status != expected:
                        response.failure(f"the job ended {status}, expected {expected}")
                    return status == expected
            time.sleep(JOB_POLL_S)
        return False

    @task(1)
    def health(self) -> None:
        self.expect("GET", "/healthz", "GET /healthz", 200)

    # --- bad requests: each must get its own 4xx ---

    @task(1)
    def oversized(self) -> None:
        if random.random() < 0.5:
            self.expect(
                "POST",
                "/v1/answer",
                "bad: body over the limit",
                413,
                data=b"x" * (MAX_BODY_BYTES + 1),
                headers={"Content-Type": "application/json"},
            )
        else:
            body = {"text": "z" * (MAX_INPUT_BYTES + 1), "questions": ["q"]}
            self.expect("POST", "/v1/jobs", "bad: document over the limit", 413, json=body)

    @task(1)
    def invalid(self) -> None:
        name, options, status = random.choice(
            [
                ("bad: not JSON", {"data": b"{not json", "headers": JSON}, 422),
                ("bad: no questions", {"json": {"text": "doc"}}, 422),
                ("bad: 17 questions", {"json": {"text": "doc", "questions": ["q"] * 17}}, 422),
                ("bad: unknown field", {"json": {"text": "d", "questions": ["q"], "x": 1}}, 422),
                ("bad: plain text body", {"data": b"hello", "headers": PLAIN}, 415),
            ]
        )
        self.expect("POST", random.choice(("/v1/answer", "/v1/jobs")), name, status, **options)

    @task(1)
    def hostile_file(self) -> None:
        """Refused at once by /v1/answer; a job takes the file, then fails with the reason."""
        name, file = random.choice(HOSTILE_FILES)
        options = {"files": {"file": file}, "data": {"questions": ["What?"]}}
        if random.random() < 0.5:
            self.expect("POST", "/v1/answer", f"bad: {name}", 422, **options)
            return
        created = self.expect("POST", "/v1/jobs", f"bad: {name} (job)", 202, **options)
        if created.status_code == 202:
            self.wait_for(created.json()["job_id"], "failed")

    @task(1)
    def forbidden_uri(self) -> None:
        uri = random.choice(FORBIDDEN_URIS)
        body = {"uri": uri, "questions": ["What?"]}
        self.expect("POST", random.choice(("/v1/answer", "/v1/jobs")), "bad: forbidden URI", 422,
                    json=body)  # fmt: skip

    @task(1)
    def bad_key(self) -> None:
        # None drops the session's key from this request.
        key = random.choice(("Bearer wrong-key-0000000000000000", f"Basic {API_KEY}", None))
        headers = {"Authorization": key}
        body = {"text": "doc", "questions": ["q"]}
        self.expect("POST", "/v1/answer", "bad: key", 401, json=body, headers=headers)

    @task(1)
    def unknown_job(self) -> None:
        job_id = random.choice(("0" * 32, "not-a-job-id", "../../etc/passwd"))
        self.expect("GET", f"/v1/jobs/{job_id}", "bad: unknown job", 404)


JSON = {"Content-Type": "application/json"}
PLAIN = {"Content-Type": "text/plain"}
QUESTION_FIELD = {"questions": ["What?"]}
HOSTILE_FILES = (
    ("binary file", ("binary.txt", bytes(range(256)) * 16, "text/plain")),
    ("empty file", ("empty.txt", b"", "text/plain")),
)
FORBIDDEN_URIS = (
    "/etc/passwd",
    "file:///etc/passwd",
    "http://169.254.169.254/latest/meta-data",
    "http://127.0.0.1:1/v1/jobs",
    "http://admin:secret-password@example.com/doc.txt",
    "s3://some-bucket/secret.txt",
    "ftp://example.com/a.txt",
)
