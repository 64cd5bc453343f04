"""Speculative decoding as served: an OpenAI-compatible server's speed, and a serving log's
acceptance (`fledge bench --url`, `--log`; `fledge tune calibrate` times servers with it).

  server  tok/s per request, time to first token (streaming), at several concurrency levels,
          in loops bounded by a request count and a time limit. Requests go only to the URL given.
  log     SGLang's "Decode batch" lines and vLLM's "SpecDecoding metrics" lines → accept length
          (SGLang's definition, bonus included), per-position acceptance, throughput; a log
          without speculation (vLLM's "Avg generation throughput" lines) is a baseline.

A request counts only when its stream ends with `data: [DONE]`: an HTML page answered with
status 200 or a stream cut short is a failure, counted as one.
"""

from __future__ import annotations

import collections
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from fledge.core.config import check_number
from fledge.core.conventions import accept_length
from fledge.core.errors import FledgeError
from fledge.core.openai_client import Client, ServerError
from fledge.perf.acceptance import chain_profile

Prompt = str | list  # a user message, or a whole chat (a list of {"role", "content"} messages)

# `fledge bench --url` sends the first two unless given --prompt-file; `tune calibrate` all of them.
PROMPTS = ["Explain speculative decoding in three paragraphs.", "Write a Python function that merges two sorted lists.",
           "List the planets of the solar system with one fact each.", "Describe how a hash map works."]

# SGLang, python/sglang/srt/managers/scheduler_metrics_mixin.py (SchedulerMetricsMixin.log_decode_stats;
# scheduler.py in older versions):
#   "Decode batch, #running-req: 1, #token: 812, token usage: 0.01, accept len: 3.12, accept rate: 0.45,
#    cuda graph: True, gen throughput (token/s): 120.50, #queue-req: 0, "
# "accept len" = (accepted + bonus) / forward passes, as fledge.core.conventions.accept_length. "accept rate"
# is absent in older versions and its denominator has changed between versions (num_draft_tokens vs
# num_draft_tokens - 1), so it is reported as logged, never compared. Without speculation the line
# has no "accept len": its gen throughput is the baseline.
_SGLANG_FIELDS = {"accept_len": r"accept len: ([\d.]+)", "accept_rate": r"accept rate: ([\d.]+)",
                  "gen": r"gen throughput \(token/s\): ([\d.]+)"}

# vLLM, vllm/v1/spec_decode/metrics.py (SpecDecodingLogging.log):
#   "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, Drafted
#    throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, Per-position acceptance rate:
#    %s, Avg Draft acceptance rate: %.1f%%"   (rates ", "-joined, %.3f each)
# Mean acceptance length = 1 + accepted / drafts (bonus included, as SGLang); per-position rate i =
# fraction of drafts whose position i was accepted, i.e. P(reached depth i).
_VLLM = re.compile(r"SpecDecoding metrics: Mean acceptance length: (?P<mal>[\d.]+), .*?"
                   r"Accepted: (?P<accepted>\d+) tokens, Drafted: (?P<drafted>\d+) tokens, "
                   r"Per-position acceptance rate: (?P<rates>[\d., ]+?), Avg Draft acceptance rate: (?P<avg>[\d.]+)%")


# vLLM, vllm/v1/metrics/loggers.py (LoggingStatLogger.log), with or without speculation:
#   "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, ..."
# Lines of an idle engine (nothing running, nothing generated) are left out of the mean.
_VLLM_GEN = re.compile(r"Avg generation throughput: (?P<gen>[\d.]+) tokens/s, Running: (?P<running>\d+) reqs")


def _vllm_generation(text: str) -> list[float]:
    return [float(m["gen"]) for m in _VLLM_GEN.finditer(text) if int(m["running"]) > 0 or float(m["gen"]) > 0]


def parse_log(path) -> dict:
    """Summary of a SGLang or vLLM server log: its speculative-decoding lines, else (a plain
    server, the baseline) its generation throughput."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        raise FledgeError(f"{path}: cannot read ({e.strerror})") from None
    vllm, gen = [m.groupdict() for m in _VLLM.finditer(text)], _vllm_generation(text)
    if vllm:
        return {**_vllm_summary(vllm), **({"gen_throughput_mean": statistics.mean(gen)} if gen else {})}
    lines = [line for line in text.splitlines() if "Decode batch" in line and "gen throughput (token/s):" in line]
    sglang = [{k: (m := re.search(p, line)) and m.group(1) for k, p in _SGLANG_FIELDS.items()} for line in lines]
    if sglang:
        return _sglang_summary(sglang)
    if gen:
        return {"engine": "vllm", "lines": len(gen), "speculative": False, "gen_throughput_mean": statistics.mean(gen)}
    raise FledgeError(f"{path}: no SGLang 'Decode batch ... gen throughput', vLLM 'SpecDecoding metrics' or vLLM "
                      "'Avg generation throughput' lines")


def _sglang_summary(rows: list[dict]) -> dict:
    spec = [r for r in rows if r["accept_len"] is not None]
    gen = [float(r["gen"]) for r in (spec or rows)]
    out = {"engine": "sglang", "lines": len(rows), "speculative": bool(spec), "gen_throughput_mean": statistics.mean(gen)}
    if spec:
        # Each line covers decode_log_interval forward passes of the whole batch; without the
        # pass counts, lines are averaged unweighted.
        out["accept_length"] = statistics.mean(float(r["accept_len"]) for r in spec)
        rates = [float(r["accept_rate"]) for r in spec if r["accept_rate"] is not None]
        out["accept_rate_as_logged"] = statistics.mean(rates) if rates else None
    return out


def _vllm_summary(rows: list[dict]) -> dict:
    accepted = sum(int(r["accepted"]) for r in rows)
    drafted = sum(int(r["drafted"]) for r in rows)
    k = len(rows[-1]["rates"].split(","))
    drafts = drafted / k  # every draft proposes num_speculative_tokens = k tokens
    reach = [0.0] * k
    for r in rows:
        w = int(r["drafted"]) / k
        for i, x in enumerate(float(v) for v in r["rates"].split(",")[:k]):
            reach[i] += w * x / max(drafts, 1e-9)
    return {"engine": "vllm", "lines": len(rows), "speculative": True, "num_speculative_tokens": k,
            "accept_length": accept_length(accepted, round(drafts)) if drafts else float("nan"),
            "accepted_tokens": accepted, "drafted_tokens": drafted, "reached_depth": reach,
            "profile": chain_profile(reach)}


def first_user_turns(source: str | None, n: int) -> list[list[dict]]:
    """The first user turn of the first n conversations of a source (a conversations file as
    `fledge prep` writes, any format it reads, or a built-in name; default mtbench), each as a
    one-message chat."""
    from fledge.data.prep import load_conversations

    records, _ = load_conversations(source or "mtbench")
    firsts = [[m] for r in records for m in r["messages"][:1] if m["role"] == "user"][:n]
    if not firsts:
        raise FledgeError(f"{source}: no conversation starts with a user turn")
    return firsts


def one_request(url: str, model: str, prompt: Prompt, max_tokens: int, timeout: float, ignore_eos: bool = False) -> dict:
    """One streamed chat completion: time to first token, tokens, decode tok/s after it.
    `ignore_eos` (vLLM and SGLang read it): every answer runs to max_tokens, so concurrency
    stays what was asked for the whole level. Not retried: a retry's time is not a request's."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    first, chunks, usage = None, 0, None
    for event in Client(url, timeout).chat_stream(body):
        usage = event.get("usage") or usage
        if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
            first = first or time.perf_counter()
            chunks += 1
    end = time.perf_counter()
    # Servers may pack several tokens in one chunk; the usage block (if sent) is exact.
    tokens = (usage or {}).get("completion_tokens") or chunks
    first = first or end
    return {"ttft_ms": 1e3 * (first - t0), "tokens": tokens, "seconds": end - t0,
            "decode_tok_s": (tokens - 1) / (end - first) if tokens > 1 and end > first else float("nan")}


@dataclass
class ServerBench:
    url: str
    prompts: list[Prompt]
    model: str | None = None  # default: the first the server lists (vLLM refuses requests naming another)
    max_tokens: int = 256
    concurrency: tuple[int, ...] = (1,)
    requests: int = 8  # per concurrency level
    duration_s: float = 120.0  # per level: no request starts after this
    timeout_s: float = 120.0
    ignore_eos: bool = False

    def __post_init__(self):
        if not self.prompts or not self.concurrency:
            raise FledgeError("bench: need prompts and at least one --concurrency level")
        check_number("--max-new-tokens", self.max_tokens, 1, integer=True, what="bench")
        check_number("--requests", self.requests, 1, integer=True, what="bench")
        for c in self.concurrency:
            check_number("--concurrency", c, 1, integer=True, what="bench")
        check_number("--duration", float(self.duration_s), 0, low_open=True, what="bench")
        check_number("--timeout", float(self.timeout_s), 0, low_open=True, what="bench")


@dataclass
class Sample:
    """What one level's requests gave: each finished request, each failure's problem, the wall time."""
    results: list[dict]
    errors: list[str]
    wall_s: float


def run_requests(cfg: ServerBench, model: str, conc: int, numbers: range) -> Sample:
    """`conc` workers take the request numbers (request i sends prompt i mod len) until all are
    taken or `duration_s` is up."""
    todo, lock, deadline = iter(numbers), threading.Lock(), time.perf_counter() + cfg.duration_s
    results, errors = [], []

    def worker():
        while time.perf_counter() < deadline:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                results.append(one_request(cfg.url, model, cfg.prompts[i % len(cfg.prompts)], cfg.max_tokens, cfg.timeout_s,
                                           cfg.ignore_eos))
            except FledgeError as e:
                errors.append(e.problem if isinstance(e, ServerError) else str(e))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as pool:
        for f in [pool.submit(worker) for _ in range(conc)]:
            f.result()
    return Sample(results, errors, time.perf_counter() - t0)


def summarize(cfg: ServerBench, conc: int, samples: list[Sample]) -> dict:
    """One level's figures from its samples; a FledgeError when no request finished."""
    results = [r for s in samples for r in s.results]
    errors = [e for s in samples for e in s.errors]
    if not results:
        if errors:
            raise FledgeError(f"{cfg.url}: all {len(errors)} requests failed; the first: {errors[0]}")
        raise FledgeError(f"{cfg.url}: no request finished within {cfg.duration_s} s")
    wall = sum(s.wall_s for s in samples)
    ttft = sorted(r["ttft_ms"] for r in results)
    rates = [r["decode_tok_s"] for r in results if r["decode_tok_s"] == r["decode_tok_s"]]  # NaN: one token only
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": conc, "requests": len(results), "errors": len(errors), "wall_s": wall,
            "tokens": tokens, "total_tok_s": tokens / wall,
            "per_request_tok_s": statistics.mean(rates) if rates else float("nan"),
            "ttft_ms_median": statistics.median(ttft), "ttft_ms_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            **({"failures": dict(collections.Counter(errors))} if errors else {})}


def run_level(cfg: ServerBench, model: str, conc: int) -> dict:
    """`conc` workers take request numbers until `requests` are taken or the time is up."""
    return summarize(cfg, conc, [run_requests(cfg, model, conc, range(cfg.requests))])


def bench_server(cfg: ServerBench) -> list[dict]:
    model = cfg.model or Client(cfg.url, cfg.timeout_s).models()[0]
    return [run_level(cfg, model, c) for c in tqdm(cfg.concurrency, desc="concurrency levels", leave=False)]


def parse_levels(text: str, flag: str) -> list[int]:
    """'1,2,4,8' as sorted distinct levels, each >= 1."""
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise FledgeError(f"{flag} {text!r}: expected integers like '1,2,4,8'") from None
    if not levels or levels[0] < 1:
        raise FledgeError(f"{flag} {text!r}: levels must be >= 1")
    return levels
