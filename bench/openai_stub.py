"""A small OpenAI-compatible server for developing against the `openai` engine kind without a
model: GET /v1/models lists one model, POST /v1/chat/completions answers with the fake engine's
deterministic reply (connectors/engines/fake.py: an update keeps the lines that hold a fact, a final
prompt names them) after `--delay-ms`, as a model's decode time.

    .venv/bin/python bench/openai_stub.py --port 8010 --model smollm2-135m-instruct

Not a model and not a benchmark: bench/soak.py uses it (`--openai-stub`) to try its load and
its checks in a minute, where the real soak runs the default engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from connectors.engines.fake import reply_to


def handler_for(model: str, delay_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if self.path.rstrip("/") != "/v1/models":
                self.send_json(404, {"error": {"message": f"no route {self.path}"}})
                return
            self.send_json(200, {"object": "list", "data": [{"id": model, "object": "model"}]})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length))
                prompt = body["messages"][-1]["content"]
            except (ValueError, KeyError, IndexError, TypeError):
                self.send_json(400, {"error": {"message": "expected a chat completion request"}})
                return
            if self.path.rstrip("/") != "/v1/chat/completions" or body.get("model") != model:
                self.send_json(404, {"error": {"message": f"no model {body.get('model')!r}"}})
                return
            time.sleep(delay_s)
            text = reply_to(prompt)
            self.send_json(200, completion(model, text, prompt))

        def send_json(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def completion(model: str, text: str, prompt: str) -> dict[str, Any]:
    prompt_tokens, completion_tokens = len(prompt.split()), len(text.split())
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True, help="the name it serves the model under")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="per completion")
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer(
        (args.host, args.port), handler_for(args.model, args.delay_ms / 1000)
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
