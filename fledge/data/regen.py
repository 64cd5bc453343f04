"""`fledge regen`: the target rewrites every assistant turn, turn by turn.

Training a drafter on what the target itself says, in the template it is served with, is
the largest single lever on acceptance. User (and system) turns are kept; assistant turn k
is regenerated from the conversation as regenerated so far, so later turns follow the
target's own earlier answers. Every user turn gets its own answer: consecutive user turns (a
multi-turn prompt set such as MT-Bench, whose turns `prep` stores one after another) are
answered turn by turn, and `--max-turns 1` keeps the first turn and its answer only.

Two back-ends answer a batch of chats: fledge's batched engine on a local device, or any
OpenAI-compatible servers (SGLang, vLLM; several URLs share the load).

Output is append-only JSONL keyed by sample id. Each finished sample is one line written with
a single write + fsync, so a kill at any moment loses at most the in-flight chunk, never
leaves a broken line (a torn tail from a crash is cut on restart; a complete last line that
only lacks its newline is kept), and a rerun continues where it stopped. Failed samples are
not written, so a rerun retries them.

A resumed run writes what an uninterrupted one would, sampled or greedy: each answer's seed
is a function of the sample id and the turn (`answer_seed`), and chunks are cut from the full
list of samples, not from those left. The engine draws a whole batch from one generator, so a
chunk it had begun is run again whole and only its missing samples are written.

Exit status: 0 when every sample was answered, 1 when some requests failed (counted per
reason, listed per sample in the summary beside OUT: a.jsonl's is a.summary.json), 2 for bad
input (a missing or wrong file, a target whose first forward is not finite, an unwritable
output).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from fledge.core.config import RegenConfig, from_args
from fledge.core.conversations import read_conversations
from fledge.core.devices import parse_dtype
from fledge.core.errors import FledgeError
from fledge.core.files import (
    append_jsonl,
    appending,
    atomic_write_json,
    check_jsonl_output,
    check_no_overlap,
    keeping,
    output_lock,
    read_jsonl,
)
from fledge.core.openai_client import Client, ServerError, with_retries


@dataclass
class Answer:
    text: str = ""
    finish: str = "stop"      # stop | length | context (the prompt does not fit) | error
    error: str | None = None  # why the request failed, when finish is "error"


def answer_seed(seed: int, sample_id: str, turn: int) -> int:
    """The sampling seed of one answer: a function of the sample and turn, never of the
    sample's place in a run, so a resumed run draws what an uninterrupted one would."""
    digest = hashlib.sha256(f"{seed}:{sample_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1  # 31 bits: every server takes it


@dataclass
class Sample:
    id: str
    source: str
    todo: list[dict]                       # original messages not yet consumed
    done: list[dict] = field(default_factory=list)
    finish: str = "stop"
    turns: int = 0
    error: str | None = None               # why its last request failed


# ----------------------------------------------------------------------------- back-ends
class EngineBackend:
    """fledge's batched engine. Chats are tokenized with the target's chat template and
    batched by similar length (right padding wastes less when lengths are close); on the
    compact engine they stream through `batch_size` rows, each refilled when it ends. A batch
    draws from one generator, seeded by its first chat's seed: rows are not independent."""

    rows_independent = False

    def __init__(self, target, cfg: RegenConfig, device: str, dtype, compile: bool = False):
        from fledge.core.target import eos_ids
        from fledge.engine.hf import build_engine_target
        self.tok, self.cfg, self.batch_size = target.tokenizer, cfg, cfg.batch_size
        self.model = build_engine_target(target.model, dtype, device, compile=compile)
        self.eos = eos_ids(target.tokenizer, target.model.generation_config)
        self.name, self.checked = target.name, False

    def text(self, tokens: list[int]) -> Answer:
        """The answer of generated tokens: "stop" if they end at an end-of-turn token (left out)."""
        ended = bool(tokens) and tokens[-1] in self.eos
        return Answer(self.tok.decode(tokens[:-1] if ended else tokens), "stop" if ended else "length")

    def check_finite(self, ids: list[int]) -> None:
        """One forward of a real prompt: NaN or Inf logits (broken weights, a dtype that
        overflows) would otherwise write answers of one repeated token and exit 0."""
        import torch
        x = torch.tensor([ids], device=next(self.model.parameters()).device)
        cache = self.model.new_cache(1, -(-len(ids) // 64) * 64)
        with torch.no_grad():
            logits = self.model.prefill(x, cache, logits_idx=torch.tensor([[len(ids) - 1]], device=x.device))[0]
        if not torch.isfinite(logits).all():
            raise FledgeError(f"{self.name}: the first forward gives NaN/Inf logits; the weights are broken "
                              f"(or overflow in this --dtype); nothing was written")
        self.checked = True

    def complete(self, prompts: list[list[int]], seed: int, progress=lambda n: None) -> list[list[int]]:
        """The tokens generated after each prompt (ids), end-of-turn token included when one
        ended it; prompts of similar length are batched together. `progress(n)` is called as
        they are done."""
        from fledge.engine.decode import generate_ar
        from fledge.engine.sampling import SamplingParams
        from fledge.engine.stream import generate_stream
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        if order and not self.checked:
            self.check_finite(prompts[order[0]])
        params = SamplingParams(self.cfg.temperature, self.cfg.top_p, self.cfg.max_new_tokens, seed)
        stream = self.model.row_groups_ok  # continuous batching (engine/stream.py): one call refills the rows
        step = max(1, len(order)) if stream else self.batch_size
        out: list[list[int]] = [[] for _ in prompts]
        for s in range(0, len(order), step):
            rows = order[s:s + step]
            gen, _ = (generate_stream(self.model, [prompts[i] for i in rows], params, self.eos, rows=self.batch_size)
                      if stream else generate_ar(self.model, [prompts[i] for i in rows], params, self.eos))
            for i, g in zip(rows, gen):
                out[i] = g
            progress(len(rows))
        return out

    def answer(self, chats: list[list[dict]], seeds: list[int], progress=lambda n: None) -> list[Answer]:
        """One answer per chat; a prompt with no room for max_new_tokens is finish "context",
        as a server's 400 is. `progress(n)` is called as answers are done."""
        from fledge.core.target import encode_chat
        ids = [encode_chat(self.tok, c) for c in chats]
        room = self.cfg.max_len - self.cfg.max_new_tokens
        out = [Answer("", "context") if len(x) > room else None for x in ids]
        fit = [i for i in range(len(ids)) if out[i] is None]
        for i, g in zip(fit, self.complete([ids[i] for i in fit], seeds[0] if seeds else 0, progress)):
            out[i] = self.text(g)
        progress(len(chats) - len(fit))
        return out


# vLLM: "maximum context length is N tokens"; SGLang: "longer than the model's context length".
_CONTEXT_WORDS = ("context length", "maximum context", "context_length", "too long")


def parse_completion(body, url: str) -> Answer:
    """The answer in a chat-completions body from `url`, or a ServerError (not to be retried)
    saying what is wrong with it."""
    if not isinstance(body, dict):
        raise ServerError(url, f"body is a JSON {type(body).__name__}")
    if "error" in body or body.get("object") == "error":
        raise ServerError(url, "error body with status 200")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ServerError(url, "fewer choices than asked (0 of 1)")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        raise ServerError(url, f"content is {'missing' if content is None else type(content).__name__}, not text")
    finish = choice.get("finish_reason")
    return Answer(content, finish if isinstance(finish, str) else "stop")


class ServerBackend:
    """OpenAI-compatible chat completions on one or more servers, with bounded concurrency,
    a deadline per request (connect, wait and read together) and retries with exponential
    backoff for what another attempt can fix (5xx, 429, timeouts, dropped connections).
    Everything else, and a request that still fails, is an Answer with finish "error";
    `failures` counts every failed attempt by reason. Each request carries its own seed, so
    rows are independent."""

    rows_independent = True

    def __init__(self, urls: list[str], model: str, cfg: RegenConfig, concurrency: int = 16,
                 timeout: float = 120.0, retries: int = 3, backoff: float = 1.0):
        if not urls or concurrency < 1 or timeout <= 0 or retries < 0:
            raise FledgeError(f"--concurrency {concurrency} (>= 1), --timeout {timeout} (> 0), "
                              f"--retries {retries} (>= 0): out of range")
        self.clients = [Client(u, timeout) for u in urls]  # each tried once an attempt: `_one` retries
        self.model, self.cfg, self.concurrency, self.retries, self.backoff = model, cfg, concurrency, retries, backoff
        self.failures: dict[str, int] = {}
        self._lock = threading.Lock()  # failures is updated from the worker threads

    def _one(self, k: int, messages: list[dict], seed: int) -> Answer:
        body = {"model": self.model, "messages": messages, "max_tokens": self.cfg.max_new_tokens,
                "temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "seed": seed, "n": 1}

        def attempt(a: int) -> Answer:  # a retry goes to the next server
            client = self.clients[(k + a) % len(self.clients)]
            try:
                return parse_completion(client.chat(body), client.url)
            except ServerError as e:
                if e.status == 400 and any(w in e.detail.lower() for w in _CONTEXT_WORDS):
                    return Answer("", "context")  # the prompt does not fit; retrying cannot help
                raise

        try:
            return with_retries(attempt, self.retries, self.backoff, self._count)
        except ServerError as e:
            return Answer("", "error", e.problem)

    def _count(self, e: ServerError) -> None:
        with self._lock:
            self.failures[e.problem] = self.failures.get(e.problem, 0) + 1

    def answer(self, chats, seeds, progress=lambda n: None) -> list[Answer]:
        with cf.ThreadPoolExecutor(self.concurrency) as pool:
            futures = [pool.submit(self._one, k, c, sd) for k, (c, sd) in enumerate(zip(chats, seeds))]
            for f in cf.as_completed(futures):
                progress(1)
            return [f.result() for f in futures]


# ----------------------------------------------------------------------------- the loop
def _next_chat(s: Sample, max_turns):
    """Advance past system turns and one user turn; return the chat to answer (ending at that
    user turn), or None when finished. A user turn that another user turn follows is answered
    before the next one is read, so a multi-turn prompt set (MT-Bench's turns) is answered turn
    by turn: turn 1, its answer, turn 2, its answer."""
    while s.todo and s.todo[0]["role"] != "assistant":
        if s.todo[0]["role"] == "user" and s.done and s.done[-1]["role"] == "user":
            break
        s.done.append(s.todo.pop(0))
    if max_turns is not None and s.turns >= max_turns:
        return None
    return list(s.done) if s.done and s.done[-1]["role"] == "user" else None


def answers_ahead(s: Sample, max_turns) -> int:
    """Upper bound of the answers a sample still needs: one per user turn not yet answered,
    capped by max_turns."""
    n = sum(m["role"] == "user" for m in s.done[-1:] + s.todo)
    return n if max_turns is None else max(0, min(n, max_turns - s.turns))


def _run_chunk(samples: list[Sample], backend, cfg: RegenConfig, bar) -> tuple[list[Sample], list[Sample]]:
    """Answer every sample turn by turn. `bar` counts answers; its total shrinks when a
    conversation ends before its last turn."""
    active, failed = list(samples), []
    while active:
        pairs = [(s, c) for s in active if (c := _next_chat(s, cfg.max_turns)) is not None]
        if not pairs:
            break
        seeds = [answer_seed(cfg.seed, s.id, s.turns) for s, _ in pairs]
        answers = backend.answer([c for _, c in pairs], seeds, progress=bar.update)
        active = []
        for (s, _), a in zip(pairs, answers):
            if a.finish == "error":
                s.error = a.error
                failed.append(s)
            elif a.finish == "context":  # the prompt alone fills the context: the conversation ends here
                s.finish = "context"
            else:
                s.done.append({"role": "assistant", "content": a.text})
                s.turns, s.finish = s.turns + 1, a.finish
                if s.todo and s.todo[0]["role"] == "assistant":
                    s.todo.pop(0)
                if a.finish == "stop":  # a cut-off answer ends the conversation: later turns would not follow it
                    active.append(s)
                    continue
            # this turn's request was counted; the turns after it will not come
            if gone := answers_ahead(s, cfg.max_turns) - (a.finish in ("error", "context")):
                bar.total = max(bar.n, bar.total - gone)
                bar.refresh()
    lost = {id(s) for s in failed}
    return [s for s in samples if id(s) not in lost], failed


def repair_tail(path: Path) -> None:
    """Make the output end at a complete line: a last line that parses as a record only
    lacks its newline (a kill between the write and the newline, or an edit) and is kept;
    anything else after the last newline is a torn write and is cut."""
    with open(path, "rb+") as f:
        data = f.read()
        cut = data.rfind(b"\n") + 1
        if cut == len(data):
            return
        try:
            whole = isinstance(json.loads(data[cut:]), dict)
        except (ValueError, RecursionError):
            whole = False
        f.write(b"\n") if whole else f.truncate(cut)
        f.flush()
        os.fsync(f.fileno())


def _check_paths(conversations: Path, out: Path) -> None:
    if not conversations.exists():
        raise FledgeError(f"{conversations}: no such file (the conversations JSONL from `fledge prep`)")
    if conversations.is_dir():
        raise FledgeError(f"{conversations}: is a directory; give its conversations file (e.g. train.jsonl)")
    if out.is_dir():
        raise FledgeError(f"{out}: is a directory; the output is a JSONL file")
    check_no_overlap(out, {"conversations": conversations})
    check_no_overlap(out.with_suffix(".summary.json"), {"conversations": conversations})
    check_jsonl_output(out, "regen")  # before repair_tail cuts anything of it


def _read_done(out: Path) -> set[str]:
    have = set()
    try:
        for lineno, r in read_jsonl(out, on_bad=lambda *a: None):
            if not (isinstance(r, dict) and "id" in r and "messages" in r):
                raise FledgeError(f"{out}:{lineno}: not a regen output record; give a new output file")
            have.add(str(r["id"]))
    except UnicodeDecodeError:
        raise FledgeError(f"{out}: not UTF-8 text; not a regen output, give a new output file") from None
    return have


_KEPT = "the samples already written are kept: rerun the same command to resume"  # what a failed write leaves


def regenerate(conversations: str | os.PathLike, out: str | os.PathLike, backend, cfg: RegenConfig,
               limit: int | None = None) -> dict:
    conversations, out = Path(conversations), Path(out)
    _check_paths(conversations, out)
    if limit is not None and limit < 1:
        raise FledgeError(f"--limit {limit}: must be >= 1")
    convs = read_conversations(conversations)[:limit]
    if not convs:
        raise FledgeError(f"{conversations}: no conversations")
    todo = [Sample(f"{c['id']}#{k}" if cfg.n > 1 else str(c["id"]), c.get("source", ""), list(c["messages"]))
            for c in convs for k in range(cfg.n)]
    with keeping(out, _KEPT):
        if out.exists():
            repair_tail(out)
        have = _read_done(out) if out.exists() else set()
    pending = [s for s in todo if s.id not in have]
    counts = {"total": len(todo), "already_done": len(todo) - len(pending), "written": 0, "failed": 0,
              "skipped_no_turn": 0, "skipped_context": 0, "finish": {}}
    failed_ids: dict[str, str] = {}
    t0 = time.time()
    total = sum(answers_ahead(s, cfg.max_turns) for s in pending)
    with appending(out, _KEPT) as f, tqdm(total=total, desc="regen", unit="answer") as bar:
        for i in range(0, len(todo), cfg.chunk):
            whole = todo[i:i + cfg.chunk]
            chunk = [s for s in whole if s.id not in have]
            if chunk and not backend.rows_independent:  # its batches must be the ones an uninterrupted run had
                bar.total += sum(answers_ahead(s, cfg.max_turns) for s in whole if s.id in have)
                chunk = whole
            if not chunk:
                continue
            kept, failed = _run_chunk(chunk, backend, cfg, bar)
            for s in failed:
                failed_ids[s.id] = s.error or "failed"
                if len(failed_ids) <= 20:
                    print(f"warning: {s.id}: request failed ({s.error}); a rerun retries it", file=sys.stderr)
            counts["failed"] += len(failed)
            for s in kept:
                if s.id in have:
                    continue
                if s.turns == 0:  # nothing to answer, or the first prompt alone fills the context
                    counts["skipped_context" if s.finish == "context" else "skipped_no_turn"] += 1
                    continue
                counts["finish"][s.finish] = counts["finish"].get(s.finish, 0) + 1
                while s.done[-1]["role"] != "assistant":  # an unanswered user turn trains nothing
                    s.done.pop()
                with keeping(out, _KEPT):
                    append_jsonl(f, {"id": s.id, "source": s.source, "messages": s.done, "finish": s.finish})
                counts["written"] += 1
    counts["seconds"] = round(time.time() - t0, 1)
    if isinstance(backend, ServerBackend):
        counts["request_errors"] = dict(backend.failures)
    counts["failed_samples"] = failed_ids
    summary = out.with_suffix(".summary.json")
    with keeping(summary, _KEPT):
        atomic_write_json(summary, counts)
    return counts


def run_regen(args):
    cfg = from_args(RegenConfig, args)
    _check_paths(Path(args.conversations), Path(args.out))  # before a target load of minutes
    read_conversations(Path(args.conversations))
    with output_lock(args.out):  # held from reading what is done to the summary: one writer
        if args.server:
            backend = ServerBackend(args.server, args.model or args.target, cfg, args.concurrency,
                                    args.timeout, args.retries)
        else:
            from fledge.core.target import load_target
            dtype = parse_dtype(args.dtype)
            target = load_target(args.target, dtype=dtype, device=args.device, chat_template=args.chat_template,
                                     chat=True)
            backend = EngineBackend(target, cfg, args.device, dtype, args.compile)
        counts = regenerate(args.conversations, args.out, backend, cfg, args.limit)
    print(json.dumps(counts, indent=2))
    if counts["failed"]:
        print(f"fledge: {counts['failed']} of {counts['total']} samples failed (reasons in "
              f"{Path(args.out).with_suffix('.summary.json')}); rerun to retry them", file=sys.stderr)
    return 0 if counts["failed"] == 0 else 1
