"""Real HTTP peers for the OpenAI adapter: a JSON reply helper, and an OpenAI-compatible chat
server that answers as `FactEngine` does (tests/fake_engine.py), for jobs that must run end to
end through the `openai` engine kind with no model server (no vLLM)."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import ClassVar

from tests.fake_engine import reply_to


class JsonHandler(http.server.BaseHTTPRequestHandler):
    """Replies with JSON, logs nothing."""

    def reply(self, status: int, body: bytes) -> None:
        with contextlib.suppress(OSError):  # the client may have given up waiting
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class FactChatHandler(JsonHandler):
    """`GET /v1/models` lists `served_model`; `POST /v1/chat/completions` replies with
    `reply_to(prompt)` after `delay_s`, token counts being word counts. Counts the completions
    it served and keeps their prompts."""

    served_model = "fact-model"
    completions = 0
    prompts: ClassVar[list[str]] = []
    delay_s = 0.0

    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/v1/models":
            self.reply(404, b'{"error": {"message": "not found"}}')
            return
        models = {"object": "list", "data": [{"id": self.served_model, "object": "model"}]}
        self.reply(200, json.dumps(models).encode())

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path.rstrip("/") != "/v1/chat/completions":
            self.reply(404, b'{"error": {"message": "not found"}}')
            return
        prompt = request["messages"][-1]["content"]
        type(self).prompts.append(prompt)
        time.sleep(self.delay_s)
        text = reply_to(prompt)
        type(self).completions += 1
        completion = {
            "id": f"fact-{self.completions}",
            "object": "chat.completion",
            "created": 0,
            "model": request["model"],
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
        self.reply(200, json.dumps(completion).encode())


@contextlib.contextmanager
def fact_chat_server() -> Iterator[str]:
    """A `FactChatHandler` server on a free loopback port, in a thread; yields its base URL
    (ending in /v1)."""
    FactChatHandler.completions, FactChatHandler.prompts, FactChatHandler.delay_s = 0, [], 0.0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FactChatHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
