"""`fledge regen`: the target rewrites every assistant turn, turn by turn.

Training a drafter on what the target itself says, in the template it is served with, is
the largest single lever on acceptance. User (and system) turns are kept; assistant turn k
is regenerated from the conversation as regenerated so far, so later turns follow the
target's own earlier answers.

Two back-ends answer a batch of chats: fledge's batched engine on a local device, or any
OpenAI-compatible servers (SGLang, vLLM; several URLs share the load).

Output is append-only JSONL keyed by sample id. Each finished sample is one line written with
a single write + fsync, so a kill at any moment loses at most the in-flight chunk, never
leaves a broken line (a torn tail from a crash is cut on restart), and a rerun continues
where it stopped. Failed samples are not written, so a rerun retries them.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from fledge.util import FledgeError, append_jsonl, atomic_write_json, read_jsonl


@dataclass
class RegenConfig:
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    n: int = 1                   # samples per conversation (needs temperature > 0 to differ)
    max_turns: int | None = None  # assistant turns to write per conversation (None = all)
    max_len: int = 2048          # prompt + answer must fit; longer turns end the conversation
    chunk: int = 256             # conversations in flight between writes
    seed: int = 0

    def __post_init__(self):
        if self.n > 1 and self.temperature == 0:
            raise FledgeError("--n > 1 with temperature 0 would write the same answer n times")
        if self.max_new_tokens >= self.max_len:
            raise FledgeError(f"max_new_tokens {self.max_new_tokens} must be < max_len {self.max_len}")


@dataclass
class Sample:
    id: str
    source: str
    todo: list[dict]                       # original messages not yet consumed
    done: list[dict] = field(default_factory=list)
    finish: str = "stop"
    turns: int = 0


# ----------------------------------------------------------------------------- back-ends
class EngineBackend:
    """fledge's batched engine. Chats are tokenized with the target's chat template and
    batched by similar length (right padding wastes less when lengths are close); on the
    compact engine they stream through `batch_size` rows, each refilled when it ends."""

    def __init__(self, target, cfg: RegenConfig, batch_size: int, device: str, dtype, compile: bool = False):
        from fledge.engine.model import build_engine_target
        self.tok, self.cfg, self.batch_size = target.tokenizer, cfg, batch_size
        self.model = build_engine_target(target.model, dtype, device, compile=compile)
        self.eos = sorted({target.tokenizer.eos_token_id, *_eos_ids(target)} - {None})

    def _ids(self, messages):
        return self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)

    def _text(self, tokens: list[int]) -> tuple[str, str]:
        """(text, finish) of generated tokens: "stop" if they end at an end-of-turn token (left out)."""
        ended = bool(tokens) and tokens[-1] in self.eos
        return self.tok.decode(tokens[:-1] if ended else tokens), "stop" if ended else "length"

    def answer(self, chats: list[list[dict]], seed: int) -> list[tuple[str, str] | None]:
        """(text, finish) per chat; a prompt with no room for max_new_tokens is ("", "context"),
        as a server's 400 is."""
        from fledge.engine.generate import SamplingParams, generate_ar
        ids = [self._ids(c) for c in chats]
        out: list[tuple[str, str] | None] = [None] * len(ids)
        room = self.cfg.max_len - self.cfg.max_new_tokens
        for i, x in enumerate(ids):
            if len(x) > room:
                out[i] = ("", "context")
        order = sorted((i for i in range(len(ids)) if out[i] is None), key=lambda i: len(ids[i]))
        if order and getattr(self.model, "row_groups_ok", False):  # continuous batching (engine/stream.py)
            from fledge.engine.stream import generate_stream
            params = SamplingParams(self.cfg.temperature, self.cfg.top_p, self.cfg.max_new_tokens, seed)
            gen, _ = generate_stream(self.model, [ids[i] for i in order], params, self.eos, rows=self.batch_size)
            for i, g in zip(order, gen):
                out[i] = self._text(g)
            return out
        for s in range(0, len(order), self.batch_size):
            rows = order[s:s + self.batch_size]
            params = SamplingParams(self.cfg.temperature, self.cfg.top_p, self.cfg.max_new_tokens, seed + s)
            gen, _ = generate_ar(self.model, [ids[i] for i in rows], params, self.eos)
            for i, g in zip(rows, gen):
                out[i] = self._text(g)
        return out


def _eos_ids(target) -> list[int]:
    gc = getattr(target.model, "generation_config", None)
    e = getattr(gc, "eos_token_id", None)
    return [e] if isinstance(e, int) else list(e or [])


class ServerBackend:
    """OpenAI-compatible chat completions on one or more servers, with bounded concurrency,
    timeouts and retries with exponential backoff. A request that still fails is None."""

    def __init__(self, urls: list[str], model: str, cfg: RegenConfig, concurrency: int = 16,
                 timeout: float = 120.0, retries: int = 3, backoff: float = 1.0):
        self.urls, self.model, self.cfg = [u.rstrip("/") for u in urls], model, cfg
        self.concurrency, self.timeout, self.retries, self.backoff = concurrency, timeout, retries, backoff
        self.failures: dict[str, int] = {}
        self._lock = threading.Lock()  # failures is updated from the worker threads

    def _post(self, url: str, body: dict) -> dict:
        req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            return json.loads(r.read())

    def _one(self, k: int, messages: list[dict], seed: int):
        body = {"model": self.model, "messages": messages, "max_tokens": self.cfg.max_new_tokens,
                "temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "seed": seed}
        for attempt in range(self.retries + 1):
            url = self.urls[(k + attempt) % len(self.urls)]  # a retry goes to the next server
            try:
                choice = self._post(url, body)["choices"][0]
                return choice["message"]["content"] or "", choice.get("finish_reason") or "stop"
            except urllib.error.HTTPError as e:
                if e.code == 400:  # vLLM/SGLang: the prompt does not fit; retrying cannot help
                    return "", "context"
                self._count(e)
            except (urllib.error.URLError, OSError, http.client.HTTPException, KeyError, IndexError,
                    TypeError, ValueError) as e:  # a server killed mid-reply raises IncompleteRead
                self._count(e)
            if attempt < self.retries:
                time.sleep(self.backoff * 2 ** attempt)
        return None

    def _count(self, e: Exception) -> None:
        with self._lock:
            self.failures[type(e).__name__] = self.failures.get(type(e).__name__, 0) + 1

    def answer(self, chats, seed):
        with cf.ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda kc: self._one(kc[0], kc[1], seed + kc[0]), enumerate(chats)))


# ----------------------------------------------------------------------------- the loop
def _next_chat(s: Sample, max_turns):
    """Advance past user/system turns; return the chat to answer, or None when finished."""
    while s.todo and s.todo[0]["role"] != "assistant":
        s.done.append(s.todo.pop(0))
    if max_turns is not None and s.turns >= max_turns:
        return None
    if s.done and s.done[-1]["role"] == "user" and (not s.todo or s.todo[0]["role"] == "assistant"):
        return list(s.done)
    return None


def _run_chunk(samples: list[Sample], backend, cfg: RegenConfig, seed: int) -> tuple[list[Sample], list[Sample]]:
    active, failed = list(samples), []
    while active:
        pairs = [(s, c) for s in active if (c := _next_chat(s, cfg.max_turns)) is not None]
        if not pairs:
            break
        answers = backend.answer([c for _, c in pairs], seed)
        active = []
        for (s, _), a in zip(pairs, answers):
            if a is None:
                failed.append(s)
                continue
            text, finish = a
            if finish == "context":  # the prompt alone fills the context: the conversation ends here
                s.finish = "context"
                continue
            s.done.append({"role": "assistant", "content": text})
            s.turns, s.finish = s.turns + 1, finish
            if s.todo and s.todo[0]["role"] == "assistant":
                s.todo.pop(0)
            if finish == "stop":  # a cut-off answer ends the conversation: later turns would not follow it
                active.append(s)
        seed += 1
    lost = {id(s) for s in failed}
    return [s for s in samples if id(s) not in lost], failed


def _open_output(path: Path):
    """Append mode, after cutting a torn final line left by a crash mid-write."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as f:
            data = f.read()
            if not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    return open(path, "a", encoding="utf-8")


def regenerate(conversations: str | os.PathLike, out: str | os.PathLike, backend, cfg: RegenConfig,
               limit: int | None = None) -> dict:
    out = Path(out)
    convs = [r for _, r in read_jsonl(conversations)][:limit]
    if not convs:
        raise FledgeError(f"{conversations}: no conversations")
    have = {r["id"] for _, r in read_jsonl(out, on_bad=lambda *a: None)} if out.exists() else set()
    todo = [Sample(f"{c['id']}#{k}" if cfg.n > 1 else c["id"], c.get("source", ""), list(c["messages"]))
            for c in convs for k in range(cfg.n)]
    pending = [s for s in todo if s.id not in have]
    counts = {"total": len(todo), "already_done": len(todo) - len(pending), "written": 0, "failed": 0,
              "skipped_no_turn": 0, "skipped_context": 0, "finish": {}}
    t0 = time.time()
    with _open_output(out) as f, tqdm(total=len(pending), desc="regen", unit="conv") as bar:
        for i in range(0, len(pending), cfg.chunk):
            kept, failed = _run_chunk(pending[i:i + cfg.chunk], backend, cfg, cfg.seed + i)
            counts["failed"] += len(failed)
            for s in kept:
                if s.turns == 0:  # nothing to answer, or the first prompt alone fills the context
                    counts["skipped_context" if s.finish == "context" else "skipped_no_turn"] += 1
                    continue
                counts["finish"][s.finish] = counts["finish"].get(s.finish, 0) + 1
                while s.done[-1]["role"] != "assistant":  # an unanswered user turn trains nothing
                    s.done.pop()
                append_jsonl(f, {"id": s.id, "source": s.source, "messages": s.done, "finish": s.finish})
                counts["written"] += 1
            bar.update(len(kept) + len(failed))
    counts["seconds"] = round(time.time() - t0, 1)
    if isinstance(backend, ServerBackend):
        counts["request_errors"] = dict(backend.failures)
    atomic_write_json(out.with_suffix(".summary.json"), counts)
    return counts


def add_cli(sub):
    p = sub.add_parser("regen", help="the target rewrites every assistant turn (engine or OpenAI servers)")
    p.add_argument("conversations", help="conversations JSONL (from `fledge prep`)")
    p.add_argument("out", help="output JSONL (appended; rerun to resume)")
    p.add_argument("--target", default="smollm2-135m", help="target for the local engine")
    p.add_argument("--server", action="append", default=[], help="OpenAI-compatible base URL (repeatable)")
    p.add_argument("--model", help="model name to request from the servers")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--max-turns", type=int)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--limit", type=int, help="only the first N conversations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true",
                   help="local engine: torch.compile its layers (on a GPU, decode attends through the prefix kernel)")
    p.set_defaults(func=_cli)


def _cli(args):
    import torch
    cfg = RegenConfig(args.max_new_tokens, args.temperature, args.top_p, args.n, args.max_turns,
                      args.max_len, args.chunk, args.seed)
    if args.server:
        backend = ServerBackend(args.server, args.model or args.target, cfg, args.concurrency,
                                args.timeout, args.retries)
    else:
        from fledge.target import load_target
        dtype = getattr(torch, args.dtype)
        target = load_target(args.target, dtype=dtype, device=args.device)
        backend = EngineBackend(target, cfg, args.batch_size, args.device, dtype, args.compile)
    counts = regenerate(args.conversations, args.out, backend, cfg, args.limit)
    print(json.dumps(counts, indent=2))
    return 0 if counts["failed"] == 0 else 1
