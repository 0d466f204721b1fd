"""A real OpenAI-compatible HTTP server on 127.0.0.1 that answers as the fake engine does
(connectors/engines/fake.py `reply_to`) and misbehaves on command: the routes the OpenAI adapter
uses (GET /v1/models, POST /v1/chat/completions), served by the standard library in a thread
of the test process, so Ray workers reach it over real HTTP.

`fault` is what the chat route does now: None (answers), "500" (an error status), "slow"
(answers after `slow_s`, past the client's timeout) or "trickle" (a 200 whose body comes one
byte at a time, each before the client's read timeout); `delay_s` delays every reply;
`pad_next_bytes` pads the next reply's text with that many spaces (a reply that makes its
reader allocate); `prompts` keeps the prompt of every chat request. `stop()` closes the port
(connections are refused) and `start()` opens it again, on the same port. As a context manager
it is started and stopped. `before_reply(n)` runs in the handler of the n-th chat request,
before it is answered: the place to change the world in the middle of a run, as FactEngine's
`before_reply` is.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from connectors.engines.fake import reply_to
from connectors.processes import free_port
from pipeline.job import JobSpec
from tests.conftest import TEST_MODEL

Fault = Literal["500", "slow", "trickle"]


class JsonHandler(http.server.BaseHTTPRequestHandler):
    """A real HTTP peer for the OpenAI adapter's tests: replies with JSON, logs nothing."""

    def reply(self, status: int, body: bytes) -> None:
        with contextlib.suppress(OSError):  # the client may have given up waiting
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def chat_completion(model: str, text: str, prompt: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fact",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": text},
            }
        ],
        "usage": {
            "prompt_tokens": len(prompt.split()),
            "completion_tokens": len(text.split()),
            "total_tokens": len(prompt.split()) + len(text.split()),
        },
    }


class FactChatServer:
    def __init__(self, model: str = "fact-model", slow_s: float = 5.0) -> None:
        self.model = model
        self.slow_s = slow_s
        self.port = free_port()
        self.fault: Fault | None = None
        self.delay_s = 0.0
        self.pad_next_bytes = 0
        self.prompts: list[str] = []
        self.before_reply: Callable[[int], None] | None = None
        self.chat_requests = 0  # every attempt the adapter made, retries included
        self.answered = 0  # chat requests answered while there was no fault
        self._lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> FactChatServer:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._server = server
        return self

    def stop(self) -> None:
        """Closes the port: from now on, connections are refused."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> FactChatServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _handler(self) -> type[JsonHandler]:
        owner = self

        class Handler(JsonHandler):
            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/models"):
                    data = [{"id": owner.model, "object": "model", "owned_by": "tests"}]
                    self.reply(200, json.dumps({"object": "list", "data": data}).encode())
                else:
                    self.reply(404, b'{"error": {"message": "no such route"}}')

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner._lock:
                    owner.chat_requests += 1
                    number = owner.chat_requests
                if owner.before_reply is not None:
                    owner.before_reply(number)
                fault = owner.fault
                if fault == "500":
                    self.reply(500, b'{"error": {"message": "the fault server fails on purpose"}}')
                    return
                prompt = body["messages"][-1]["content"]
                with owner._lock:
                    owner.prompts.append(prompt)
                    pad, owner.pad_next_bytes = owner.pad_next_bytes, 0
                time.sleep(owner.delay_s)
                text = reply_to(prompt) + " " * pad
                answer = json.dumps(chat_completion(owner.model, text, prompt)).encode()
                if fault == "slow":
                    time.sleep(owner.slow_s)
                if fault == "trickle":
                    self._trickle(answer)
                    return
                self.reply(200, answer)
                if fault is None:
                    with owner._lock:
                        owner.answered += 1

            def _trickle(self, answer: bytes) -> None:
                """Headers, then a space every 0.3 s for up to a minute: each read of the
                client gets a byte before its timeout, and the body never ends."""
                with contextlib.suppress(OSError):
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer) + 1000))
                    self.end_headers()
                    for _ in range(200):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(0.3)

        return Handler


QUESTION = "Which facts do the reports hold?"


def reports(count: int = 2, lines: int = 6) -> dict[str, tuple[str, set[str]]]:
    """`count` reports of `lines` lines, each line with a fact: name -> (text, its facts)."""
    made = {}
    for index in range(count):
        rows = [
            f"Line {k} of report {index} notes fact-r{index}l{k} in passing." for k in range(lines)
        ]
        made[f"report-{index}.txt"] = (
            "\n".join(rows) + "\n",
            {f"fact-r{index}l{k}" for k in range(lines)},
        )
    return made


def write_reports(folder: Path, count: int = 2) -> dict[str, set[str]]:
    """The reports as files in `folder`; returns each one's facts."""
    folder.mkdir()
    for name, (text, _) in reports(count).items():
        (folder / name).write_text(text)
    return {name: facts for name, (_, facts) in reports(count).items()}


def fact_job(
    server: FactChatServer,
    sources: list[Any],
    output: str | dict[str, Any],
    engine: dict[str, Any] | None = None,
    **fields: Any,
) -> JobSpec:
    """A job on the server's model: segmented by the test model's tokenizer, in segments that
    end at a line's end (no fact is cut in two), with room for every fact in the memory."""
    return JobSpec.from_dict(fact_job_fields(server, sources, output, engine, **fields))


def fact_job_fields(
    server: FactChatServer,
    sources: list[Any],
    output: str | dict[str, Any],
    engine: dict[str, Any] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """`fact_job` as a user writes it in a job file."""
    return {
        "sources": sources,
        "questions": [QUESTION],
        "output": output,
        "engine": {
            "kind": "openai",
            "model": TEST_MODEL,
            "served_model": server.model,
            "base_url": server.base_url,
            **(engine or {}),
        },
        "method": {
            "template": "memagent-reference",
            "chunk_size": 32,
            "snap_window": 24,
            "max_memory_tokens": 96,
            "max_answer_tokens": 48,
        },
        **fields,
    }
