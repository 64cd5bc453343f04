"""One client for OpenAI-compatible servers (vLLM, SGLang): the model list, chat completions
plain and streamed, and the Prometheus metrics text.

Every failure is a `ServerError`: one line naming the URL and what went wrong, `retry` saying
whether another attempt may help (a refused or dropped connection, a timeout, a reply cut
short, HTTP 5xx, 408 or 429). `with_retries` is the one retry loop, with exponential backoff.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from fledge.core.errors import FledgeError

T = TypeVar("T")


class ServerError(FledgeError):
    """A request without a usable answer. `str()` is `<url>: <problem>`; `problem` alone names
    what failed (failures are counted by it), `status` is the HTTP status when one came,
    `detail` the start of an error reply's body."""

    def __init__(self, url: str, problem: str, retry: bool = False, status: int | None = None, detail: str = ""):
        super().__init__(f"{url}: {problem}")
        self.url, self.problem, self.retry, self.status, self.detail = url, problem, retry, status, detail


def api_url(url: str, leaf: str) -> str:
    """`<base>/v1/<leaf>` of a server URL given with or without /v1, or as a full endpoint."""
    base = url.rstrip("/").removesuffix("/chat/completions").removesuffix("/models")
    return f"{base if base.endswith('/v1') else base + '/v1'}/{leaf}"


def metrics_url(url: str) -> str:
    """vLLM and SGLang serve Prometheus metrics at /metrics on the API's host and port."""
    u = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((u.scheme, u.netloc, "/metrics", "", ""))


def with_retries(attempt: Callable[[int], T], retries: int, backoff: float,
                 on_failure: Callable[[ServerError], None] = lambda e: None) -> T:
    """`attempt(k)` for k = 0, 1, ... until one returns, one fails with `retry` False, or
    `retries` + 1 have failed (that ServerError is raised). `on_failure` sees every failed
    attempt; failure k is followed by a sleep of backoff * 2**k."""
    k = 0
    while True:
        try:
            return attempt(k)
        except ServerError as e:
            on_failure(e)
            if not e.retry or k >= retries:
                raise
        time.sleep(backoff * 2 ** k)
        k += 1


@dataclass
class Client:
    """One server. `timeout`: seconds a request may take in all (connect, wait and read), and
    for a stream the longest wait for its next line. Each call is one attempt: a caller that
    retries wraps its calls in `with_retries` (a benchmark must see a failure, not a retry)."""

    url: str
    timeout: float = 120.0

    def models(self) -> list[str]:
        """The ids of the models the server lists (vLLM refuses requests naming another)."""
        where = api_url(self.url, "models")
        reply = self._json(where, self._read(where))
        try:
            ids = [m["id"] for m in reply["data"]]
        except (KeyError, TypeError):
            ids = []
        if not ids:
            raise ServerError(where, "no model list in the answer")
        return ids

    def chat(self, body: dict) -> dict:
        """One chat completion: the reply's JSON body, whatever it holds."""
        where = api_url(self.url, "chat/completions")
        with self._naming_models(body):
            return self._json(where, self._read(where, body))

    def completion(self, body: dict) -> dict:
        """One text completion (a prompt of text or token ids): the reply's JSON body."""
        where = api_url(self.url, "completions")
        return self._json(where, self._read(where, body))

    def root_json(self, path: str, body: dict | None = None):
        """The JSON reply of `path` beside the API, not under /v1 (vLLM's /version, SGLang's
        /generate): a GET, or a POST of `body`."""
        where = api_url(self.url, "models").removesuffix("/v1/models") + path
        return self._json(where, self._read(where, body))

    def chat_stream(self, body: dict) -> Iterator[dict]:
        """The JSON events of one streamed chat completion, up to `data: [DONE]`. A reply
        without it (a proxy's HTML page, a stream cut short) is a ServerError: its tokens are
        not a whole answer."""
        where = api_url(self.url, "chat/completions")
        with self._naming_models(body):
            r = self._open(where, {**body, "stream": True})
        with r:
            try:
                for raw in r:
                    line = raw.decode(errors="replace").strip()
                    if line == "data: [DONE]":
                        return
                    if line.startswith("data:"):
                        try:
                            yield json.loads(line[5:])
                        except ValueError:
                            raise ServerError(where, f"stream event is not JSON: {line[:80]!r}") from None
            except (OSError, http.client.HTTPException) as e:  # a read timeout or a dropped connection
                raise ServerError(where, f"stream broke off ({str(e) or type(e).__name__})") from None
        kind = r.headers.get_content_type()
        raise ServerError(where, "stream ended before `data: [DONE]`" + ("" if kind == "text/event-stream" else
                                                                        f" (the reply is {kind}, not an event stream)"))

    @contextlib.contextmanager
    def _naming_models(self, body: dict):
        """A 404 for a request naming a model: add the names the server does serve."""
        try:
            yield
        except ServerError as e:
            if e.status != 404 or "model" not in body:
                raise
            try:
                served = ", ".join(self.models())
            except ServerError:
                raise e from None
            raise ServerError(e.url, f"{e.problem}: model {body['model']!r} is not served here; it serves {served}",
                              e.retry, e.status, e.detail) from None

    def metrics(self, url: str | None = None) -> str:
        """The Prometheus text at `url` (default: `metrics_url` of the server's)."""
        where = url or metrics_url(self.url)
        return self._read(where).decode(errors="replace")

    # ------------------------------------------------------------------ one attempt
    def _open(self, where: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(where, data, {"Content-Type": "application/json"} if data else {})
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            try:
                detail = e.read(4096).decode("utf-8", "replace")
            except OSError:
                detail = ""
            retry = e.code >= 500 or e.code in (408, 429)  # the server's own errors, a timeout, a rate limit
            raise ServerError(where, f"HTTP {e.code} {e.reason}".rstrip(), retry, e.code, detail) from None
        except urllib.error.URLError as e:  # refused, unknown host, a connect that timed out
            raise ServerError(where, f"server not answering ({e.reason})", retry=True) from None
        except (OSError, http.client.HTTPException) as e:  # no reply in time, a connection dropped
            raise ServerError(where, f"no reply ({type(e).__name__})", retry=True) from None

    def _read(self, where: str, body: dict | None = None) -> bytes:
        deadline = time.monotonic() + self.timeout
        try:
            with self._open(where, body) as r:
                data = b""
                while block := r.read(1 << 16):  # the socket timeout is per read: bound the total too
                    data += block
                    if time.monotonic() > deadline:
                        raise ServerError(where, f"no reply (not complete after {self.timeout:g} s)", retry=True)
        except (OSError, http.client.HTTPException) as e:  # a server killed mid-reply: IncompleteRead
            raise ServerError(where, f"no reply ({type(e).__name__})", retry=True) from None
        return data

    @staticmethod
    def _json(where: str, data: bytes):
        try:
            return json.loads(data)
        except (ValueError, RecursionError):
            raise ServerError(where, "reply is not JSON", retry=True) from None
