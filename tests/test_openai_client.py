"""fledge.core.openai_client against a local stdlib HTTP server: the model list, plain and streamed
chat, metrics, which failures are retried (and how long it waits between), and the one line a
failure reads as."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fledge.core.openai_client import (
    Client,
    ServerError,
    api_url,
    metrics_url,
    with_retries,
)


class Scripted(BaseHTTPRequestHandler):
    """POST answers with the next status of `script` (then 200 for good); the last user
    message picks a special reply: "stream", "bad-stream", "slow", "trickle", "html"."""

    script: list = []
    calls: list = []

    def log_message(self, *a):
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        type(self).calls.append(("GET", self.path))
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "tiny"}, {"id": "other"}]}).encode())
        elif self.path == "/metrics":
            self._send(200, b"vllm:spec_decode_num_drafts_total 7\n", "text/plain")
        else:
            self._send(404, b"{}")

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append(("POST", self.path, req))
        if type(self).script:
            status = type(self).script.pop(0)
            self._send(status, json.dumps({"object": "error", "message": f"status {status}"}).encode())
            return
        ask = req["messages"][-1]["content"]
        if ask in ("stream", "bad-stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(3):
                self.wfile.write(f"data: {json.dumps({'choices': [{'delta': {'content': f't{i}'}}]})}\n\n".encode())
                self.wfile.flush()
            if ask == "bad-stream":
                self.wfile.write(b"data: {not json\n\n")
            self.wfile.write(b"data: [DONE]\n\ndata: {\"after\": \"done\"}\n\n")
            return
        if ask == "slow":
            time.sleep(1.0)
        if ask == "html":
            self._send(200, b"<html>not an API</html>", "text/html")
            return
        body = json.dumps({"choices": [{"message": {"content": "echo " + ask}, "finish_reason": "stop"}]}).encode()
        if ask == "trickle":  # every read comes in time, the whole reply does not
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for b in body:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(0.02)
            return
        self._send(200, body)


@pytest.fixture
def server():
    handler = type("H", (Scripted,), {"script": [], "calls": []})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    srv.shutdown()
    srv.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def chat(text: str) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4}


def test_urls():
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/models",
                "http://h:8000/v1/chat/completions"):
        assert api_url(url, "models") == "http://h:8000/v1/models"
    assert metrics_url("http://h:8000/v1") == "http://h:8000/metrics"


def test_models_chat_and_metrics(server):
    url, h = server
    for base in (url, url + "/v1"):
        assert Client(base).models() == ["tiny", "other"]
    reply = Client(url).chat(chat("hi"))
    assert reply["choices"][0]["message"]["content"] == "echo hi"
    assert h.calls[-1][:2] == ("POST", "/v1/chat/completions") and "stream" not in h.calls[-1][2]
    assert Client(url).metrics() == "vllm:spec_decode_num_drafts_total 7\n"
    assert Client("http://127.0.0.1:9").metrics(url + "/metrics").startswith("vllm:")


def test_stream_yields_events_up_to_done(server):
    url, h = server
    events = list(Client(url).chat_stream(chat("stream")))
    assert [e["choices"][0]["delta"]["content"] for e in events] == ["t0", "t1", "t2"]  # nothing after [DONE]
    assert h.calls[-1][2]["stream"] is True
    with pytest.raises(ServerError, match="stream event is not JSON"):
        list(Client(url).chat_stream(chat("bad-stream")))


@pytest.mark.parametrize("status", [500, 503, 408, 429])
def test_retryable_statuses_are_retried_with_backoff(server, status):
    url, h = server
    h.script = [status, status]
    t0 = time.perf_counter()
    reply = with_retries(lambda k: Client(url).chat(chat("hi")), 2, 0.1)
    assert reply["choices"][0]["message"]["content"] == "echo hi"
    assert len(h.calls) == 3 and time.perf_counter() - t0 >= 0.1 + 0.2  # backoff * 2**k after failure k
    h.script = [status, status]
    with pytest.raises(ServerError) as e:
        with_retries(lambda k: Client(url).chat(chat("hi")), 1, 0.01)
    assert e.value.retry and e.value.status == status and f"HTTP {status}" in e.value.problem
    h.script = [status]  # a stream that fails to open fails as retryable
    assert len(with_retries(lambda k: list(Client(url).chat_stream(chat("stream"))), 1, 0.01)) == 3


@pytest.mark.parametrize("status", [400, 404, 422])
def test_other_statuses_are_not_retried(server, status):
    url, h = server
    h.script = [status]
    with pytest.raises(ServerError) as e:
        with_retries(lambda k: Client(url).chat(chat("hi")), 3, 0.01)
    assert len([c for c in h.calls if c[0] == "POST"]) == 1 and not e.value.retry and e.value.status == status
    assert json.loads(e.value.detail)["message"] == f"status {status}"  # the body, for the caller to read
    # A 404 naming a model: the line lists what the server serves (it asked /v1/models once).
    served = "it serves tiny, other"
    assert (served in str(e.value)) == (status == 404) and "\n" not in str(e.value)
    assert h.calls[1:] == ([("GET", "/v1/models")] if status == 404 else [])


def test_failures_are_one_line_naming_the_url(server):
    url, _ = server
    port = closed_port()
    cases = [(Client(f"http://127.0.0.1:{port}"), chat("hi"), f"http://127.0.0.1:{port}/v1/chat/completions",
              "server not answering", True),
             (Client(url, timeout=0.3), chat("slow"), f"{url}/v1/chat/completions", "no reply (TimeoutError)", True),
             (Client(url, timeout=0.3), chat("trickle"), f"{url}/v1/chat/completions", "not complete after 0.3 s", True),
             (Client(url), chat("html"), f"{url}/v1/chat/completions", "reply is not JSON", True)]
    for client, body, where, phrase, retry in cases:
        with pytest.raises(ServerError) as e:
            client.chat(body)
        line = str(e.value)
        assert line.startswith(where + ": ") and phrase in line and "\n" not in line, line
        assert e.value.retry is retry and e.value.status is None
    with pytest.raises(ServerError, match=rf"^{url}/missing: HTTP 404 Not Found$"):
        Client(url).metrics(url + "/missing")


def test_with_retries_counts_every_failure():
    seen, calls = [], []

    def attempt(k):
        calls.append(k)
        raise ServerError("http://x", f"down {k}", retry=True)

    with pytest.raises(ServerError, match="down 2"):
        with_retries(attempt, 2, 0.0, seen.append)
    assert calls == [0, 1, 2] and [e.problem for e in seen] == ["down 0", "down 1", "down 2"]
    assert with_retries(lambda k: k if k == 1 else attempt(k), 5, 0.0) == 1
    calls.clear()

    def bad(k):
        calls.append(k)
        raise ServerError("http://x", "bad")  # not retryable

    with pytest.raises(ServerError, match="^http://x: bad$"):
        with_retries(bad, 5, 0.0)
    assert calls == [0]
