"""Launch-line lint: an SGLang or vLLM server command checked against the drafter it serves.

The flags that cost deployments hours are the silent ones: `--speculative-algorithm EAGLE`
with an EAGLE-3 drafter starts fine and serves correct text while the aux capture is off
(accept length ~1.0); a context length past the drafter's positions; a tree shape SGLang
quietly overrides.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from fledge.core.shape import max_nodes  # also SGLang's verify-set bound (see its doc)
from fledge.doctor.checks import PASS, Check, fail, ok, warn
from fledge.drafter.layout import DraftFacts

# Deeper than the training-time-test unroll (7 in SpecForge/EAGLE), extra draft tokens are
# rarely accepted but each costs a draft forward.
MAX_USEFUL_DEPTH = 7


# SGLang's argparse accepts unambiguous prefixes (`--speculative-algo`, `--model`), read as these.
SGLANG_OPTIONS = ["model-path", "speculative-algorithm", "speculative-draft-model-path", "speculative-num-steps",
                  "speculative-eagle-topk", "speculative-num-draft-tokens", "disable-cuda-graph", "context-length"]
VLLM_REMOVED = {"speculative-model", "num-speculative-tokens", "speculative-draft-tensor-parallel-size"}


@dataclass
class Launch:
    engine: str  # "sglang" | "vllm"
    model: str | None
    options: dict[str, str | None]  # "--a-b value" as {"a-b": "value"}; bare flags map to None
    env: dict[str, str]  # NAME=value words before the engine (`env A=1 python -m ...`)

    def on_cpu(self) -> bool:
        """vLLM's CPU build (VLLM_TARGET_DEVICE=cpu, as fledge's CPU venv sets it) or `--device cpu`:
        no CUDA graphs to lose, so --enforce-eager costs nothing there."""
        return self.env.get("VLLM_TARGET_DEVICE") == "cpu" or self.options.get("device") == "cpu"


def _engine_at(tokens: list[str]) -> tuple[int, str] | None:
    """Where the server's own arguments start: the engine's module or command (`-m
    sglang.launch_server`, `vllm serve`, `-m vllm.entrypoints...`), not a path that merely
    names an engine (/opt/vllm-venv/bin/python); else a container image naming one
    (vllm/vllm-openai, whose arguments follow it)."""
    named = [(i, e) for i, tok in enumerate(tokens) for e in ("sglang", "vllm") if e in tok]
    for i, e in named:
        name = tokens[i].rsplit("/", 1)[-1]
        if name == e or name.startswith(e + "."):
            return i, e
    return named[0] if named else None


def parse_launch(cmd: str) -> Launch | str:
    """A Launch, or why the line could not be read. Handles env prefixes, `\\` line
    continuations, `--k=v`, `vllm serve MODEL`, and SGLang's abbreviated options."""
    try:
        tokens = [t for t in shlex.split(cmd.replace("\\\n", " ")) if t.strip()]
    except ValueError as e:
        return f"cannot split the command line ({e})"
    found = _engine_at(tokens)
    if found is None:
        return "neither an SGLang (python -m sglang.launch_server) nor a vLLM (vllm serve) command"
    at, engine = found
    rest, model = tokens[at + 1:], None
    if rest[:1] == ["serve"]:
        rest = rest[1:]
        if rest and not rest[0].startswith("-"):
            model, rest = rest[0], rest[1:]
    options, i = {}, 0
    while i < len(rest):
        tok = rest[i]
        i += 1
        if not tok.startswith("-"):
            continue
        key, eq, val = tok.lstrip("-").partition("=")
        if not eq:
            nxt = rest[i] if i < len(rest) else None
            is_value = nxt is not None and (not nxt.startswith("-") or nxt.lstrip("-").replace(".", "").isdigit())
            val, i = (nxt, i + 1) if is_value else (None, i)
        head, dot, sub = key.partition(".")  # vLLM's --speculative-config.num_speculative_tokens 3
        options[_canonical(head.replace("_", "-"), engine) + dot + sub] = val
    model = options.get("model-path" if engine == "sglang" else "model", model)
    env = dict(t.split("=", 1) for t in tokens[:at] if "=" in t and not t.startswith("-") and t.split("=", 1)[0].isidentifier())
    return Launch(engine, model, options, env)


def _canonical(key: str, engine: str) -> str:
    if engine != "sglang" or key in SGLANG_OPTIONS:
        return key
    hits = [o for o in SGLANG_OPTIONS if o.startswith(key)]
    return hits[0] if len(hits) == 1 else key


def _int(v) -> int | None:
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return None


def _path_check(given: str | None, drafter: Path, flag: str) -> Check:
    name = "launch.draft_path"
    if not given:
        return fail(name, f"no {flag}: the engine has no drafter to load", f"add {flag} {drafter}")
    p = Path(given).expanduser()
    if not p.exists():
        if given.startswith(("/", ".", "~")):
            return fail(name, f"{flag} {given}: no such directory here; the server fails to load it",
                        f"use {flag} {drafter}, or run doctor where {given} exists")
        return warn(name, f"{flag} {given} is not on this machine (an HF hub id?): cannot tell if it is the "
                     "checked drafter", f"run doctor on {given} itself, where it lives")
    if p.resolve() != drafter.resolve():
        return fail(name, f"{flag} {given} is not the drafter checked here ({drafter})", f"use {flag} {drafter}")
    return ok(name, f"{flag} is the checked drafter")


def _sglang_steps(o: dict) -> Check:
    name = "launch.tree"
    raw = [o.get(k) for k in ("speculative-num-steps", "speculative-eagle-topk", "speculative-num-draft-tokens")]
    if raw == [None] * 3:
        return ok(name, "steps/topk/draft tokens left to SGLang's per-model choice (e.g. Llama 5/4/8, others 3/1/4)")
    if raw[0] is None:
        return fail(name, "--speculative-eagle-topk/--speculative-num-draft-tokens without --speculative-num-steps: "
                     "SGLang asserts at start", "give all three, or none")
    steps, topk, ndt = (_int(v) for v in raw)
    topk = 1 if raw[1] is None else topk
    ndt = steps + 1 if raw[2] is None and steps is not None and topk == 1 else ndt
    if None in (steps, topk, ndt) or min(steps, topk, ndt) < 1:
        return fail(name, f"steps={raw[0]} topk={raw[1]} draft tokens={raw[2]}: each must be an integer >= 1",
                     "e.g. --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4")
    if topk == 1 and ndt != steps + 1:
        return warn(name, f"chain (topk 1) with num_draft_tokens {ndt}: SGLang overrides it to steps+1 = {steps + 1}",
                     f"--speculative-num-draft-tokens {steps + 1}")
    bound = max_nodes(steps, topk)
    if ndt > bound:
        return fail(name, f"num_draft_tokens {ndt} > 1 + topk + (steps-1)*topk^2 = {bound} candidates: the tree "
                     "selection fails at the first decode", f"--speculative-num-draft-tokens <= {bound}")
    if ndt - 1 < steps:
        return warn(name, f"tree of {ndt - 1} draft tokens is at most {ndt - 1} deep, but {steps} draft steps run: "
                     "the deepest steps are computed and never verified",
                     f"--speculative-num-steps {ndt - 1} (or more draft tokens)")
    return ok(name, f"steps {steps}, topk {topk}, draft tokens {ndt} (bound {bound})")


def _context_check(flag: str, value, f: DraftFacts | None) -> Check | None:
    n = _int(value)
    if value is None or f is None or f.max_position is None:
        return None
    if n is None or n > f.max_position:
        return fail("launch.context", f"{flag} {value} > drafter max_position_embeddings {f.max_position}",
                    f"raise max_position_embeddings in the drafter's config.json to {value}, or lower {flag}")
    return ok("launch.context", f"{flag} {n} within the drafter's {f.max_position}")


def _served_config(model: str) -> dict | None:
    """The config.json of the model a line serves: a local directory's, or an HF hub id's if the
    HF cache holds it (never fetched); None where neither is here."""
    p = Path(model).expanduser()
    path = p / "config.json" if p.is_dir() else None
    if path is None and model.count("/") == 1 and not model.startswith(("/", ".", "~")):
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model, "config.json")
        path = Path(hit) if isinstance(hit, str) else None
    try:
        cfg = json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def recorded_target(drafter: Path, f: DraftFacts | None) -> str | None:
    """The target a drafter names: the speculators verifier, or what `fledge export` records."""
    if f is not None and f.verifier:
        return f.verifier
    try:
        name = json.loads((drafter / "config.json").read_text())["fledge"]["verifier"]["name_or_path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) and name else None


def _names_agree(served: str, recorded: str) -> bool:
    """An HF id or path and a recorded name for the same model (`HuggingFaceTB/SmolLM2-135M-Instruct`
    and `smollm2-135m`): one's last part holds the other's."""
    a, b = (x.rstrip("/").rsplit("/", 1)[-1].lower() for x in (served, recorded))
    return a in b or b in a


def model_check(served: str | None, drafter: Path, f: DraftFacts | None, target: str | None) -> Check | None:
    """The model a line serves must be the drafter's target: layers, hidden size and vocab as the
    drafter records them (or, where no config is here to read, its recorded name)."""
    name, recorded = "launch.model", recorded_target(drafter, f)
    if not served:
        return fail(name, "no model in the line: vLLM serves its default (facebook/opt-125m), SGLang refuses",
                    f"name the target: --model {recorded or '<target>'}")
    cfg = _served_config(served)
    p = Path(served).expanduser()
    if cfg is not None and (p.exists() and p.resolve() == drafter.resolve() or "speculators_config" in cfg
                            or any("eagle" in str(a).lower() for a in cfg.get("architectures") or [])):
        return fail(name, f"serves {served}, a drafter, as the target", f"serve the target: --model {recorded or '<target>'}")
    if cfg is None:
        if f is None or recorded is None:
            return _target_path_check(served, target)
        if _names_agree(served, recorded):
            return warn(name, f"serves {served} (the drafter names {recorded}); its config.json is not here to compare "
                        "layers, hidden size and vocab", "run doctor where the model's directory or HF cache is")
        return fail(name, f"serves {served}, but the drafter's target is {recorded} (and {served}'s config.json is "
                    "not here to compare)", f"serve {recorded}, or run doctor where {served}'s config.json is")
    if f is None:
        return _target_path_check(served, target)
    text = cfg.get("text_config") or cfg
    want = (("layers", "num_hidden_layers", f.target_layers), ("hidden size", "hidden_size", f.target_hidden),
            ("vocab", "vocab_size", f.vocab))
    diffs = [f"{what} {text.get(key)} (drafter's target: {n})" for what, key, n in want
             if n is not None and text.get(key) != n]
    if diffs:
        return fail(name, f"serves {served}, not the drafter's target: " + ", ".join(diffs),
                    f"serve {recorded or 'the target the drafter was trained on'}")
    other = _target_path_check(served, target)
    if other is not None and other.status != PASS:
        return other
    return ok(name, f"serves {served}: " + ", ".join(f"{what} {text.get(key)}" for what, key, n in want if n is not None)
              + ", as the drafter's target")


def _target_path_check(served: str, target: str | None) -> Check | None:
    if not target or not Path(target).exists() or not Path(served).exists():
        return None
    if Path(served).resolve() != Path(target).resolve():
        return warn("launch.model", f"serves {served}, but the drafter was checked against {target}",
                     "run doctor with --target set to the served model")
    return ok("launch.model", "serves the checked target")


def _sglang_checks(lc: Launch, drafter: Path, f: DraftFacts | None) -> list[Check]:
    o = lc.options
    algo = (o.get("speculative-algorithm") or "").upper()
    if algo == "EAGLE3":
        out = [ok("launch.algorithm", "EAGLE3: the target captures the three aux hidden states")]
    elif algo == "EAGLE":
        out = [fail("launch.algorithm", "--speculative-algorithm EAGLE with an EAGLE-3 drafter: aux capture is off, "
                     "the drafter sees only the last hidden state and accept length collapses to ~1.0",
                     "--speculative-algorithm EAGLE3")]
    else:
        out = [fail("launch.algorithm", f"--speculative-algorithm {algo or '(absent)'}: EAGLE-3 drafter not used",
                     "--speculative-algorithm EAGLE3")]
    if f is not None and f.ptd_token_id is not None:
        # SGLang's LlamaForCausalLMEagle3 (read in its source) has no mask_hidden, and its EAGLE3
        # worker drafts step by step: a P-EAGLE drafter's later drafts were trained on mask slots
        out.append(fail("launch.parallel_drafting", "a P-EAGLE drafter (ptd_token_id) under SGLang's EAGLE3: it "
                        "drafts step by step, drops mask_hidden, and feeds the drafter states it was not trained on "
                        "past the first draft", 'serve it with vLLM ("parallel_drafting": true), or train an '
                        "EAGLE-3 drafter for SGLang"))
    out += [_path_check(o.get("speculative-draft-model-path"), drafter, "--speculative-draft-model-path"),
            _sglang_steps(o)]
    if "disable-cuda-graph" in o:
        out.append(warn("launch.cuda_graph", "--disable-cuda-graph: every draft step and verify pays kernel-launch "
                         "overhead, which often eats the speculative gain", "drop --disable-cuda-graph"))
    out.append(_context_check("--context-length", o.get("context-length"), f))
    return out


def _serves_speculators_dir(lc: Launch, drafter: Path, f: DraftFacts | None) -> bool:
    """`vllm serve <dir>` on the checked drafter in the speculators layout: vLLM speculates with
    no --speculative-config, taking the target from speculators_config.verifier."""
    if lc.engine != "vllm" or f is None or f.layout != "speculators" or not lc.model:
        return False
    p = Path(lc.model).expanduser()
    return p.exists() and p.resolve() == drafter.resolve()


def _vllm_checks(lc: Launch, drafter: Path, f: DraftFacts | None, alone: bool) -> list[Check]:
    o = lc.options
    out = [fail("launch.legacy", f"--{k} was removed from vLLM", "use --speculative-config JSON")
           for k in sorted(VLLM_REMOVED & set(o))]
    sc = {k.split(".", 1)[1]: v for k, v in o.items() if k.startswith("speculative-config.")}
    raw = o.get("speculative-config")
    if raw is not None:
        try:
            sc = json.loads(raw)
        except json.JSONDecodeError as e:
            return out + [fail("launch.spec_config", f"--speculative-config is not JSON ({e.msg})",
                                '--speculative-config \'{"method": "eagle3", "model": "...", "num_speculative_tokens": 3}\'')]
    if alone:
        # vLLM reads speculators_config: the verifier becomes the served model, the directory the
        # drafter, the method and depth come from the config; --speculative-config may only add to
        # them (method and model stay locked).
        given = sc if isinstance(sc, dict) else {}
        sc = {"num_speculative_tokens": f.speculative_tokens, **given, "method": "eagle3", "model": str(drafter)}
        if f.ptd_token_id is not None:  # speculators' peagle type: vLLM turns parallel drafting on itself
            sc["parallel_drafting"] = True
        out.append(ok("launch.spec_config", f"serves a speculators directory: vLLM loads the verifier {f.verifier} "
                      f"as the target and this directory as its eagle3 drafter"))
    elif not isinstance(sc, dict) or not sc:
        return out + [fail("launch.spec_config", "no --speculative-config: vLLM serves without speculation",
                            f'--speculative-config \'{{"method": "eagle3", "model": "{drafter}", "num_speculative_tokens": 3}}\'')]
    out += [_vllm_method(sc), _path_check(sc.get("model"), drafter, 'speculative_config "model"'),
            _vllm_depth(sc.get("num_speculative_tokens")), _vllm_parallel(sc.get("parallel_drafting"), f)]
    if "enforce-eager" in o and not lc.on_cpu():
        out.append(warn("launch.cuda_graph", "--enforce-eager: no CUDA graphs, kernel-launch overhead on every "
                         "draft and verify step", "drop --enforce-eager"))
    out.append(_context_check("--max-model-len", o.get("max-model-len"), f))
    return out


def _vllm_method(sc: dict) -> Check:
    method = str(sc.get("method") or "")
    if method == "eagle3":
        return ok("launch.algorithm", "method eagle3: the target captures the three aux hidden states")
    if method == "eagle":
        return fail("launch.algorithm", 'method "eagle" with an EAGLE-3 drafter: vLLM captures no aux hidden '
                    "states and acceptance collapses", '"method": "eagle3"')
    if not method and "eagle3" in str(sc.get("model", "")).lower():
        return warn("launch.algorithm", "no method: vLLM guesses eagle3 from the model name", '"method": "eagle3"')
    return fail("launch.algorithm", f"method {method or '(absent)'}: not eagle3", '"method": "eagle3"')


def _vllm_parallel(on, f: DraftFacts | None) -> Check | None:
    """A P-EAGLE drafter (ptd_token_id) is served with parallel_drafting, and only such a one."""
    trained = f is not None and f.ptd_token_id is not None
    if trained and on is not True:
        return fail("launch.parallel_drafting", "a P-EAGLE drafter (ptd_token_id) served without parallel_drafting: "
                    "vLLM drafts step by step, feeding it states it was not trained on", '"parallel_drafting": true')
    if on and f is not None and not trained:
        return fail("launch.parallel_drafting", "parallel_drafting with a drafter that has no ptd_token_id and "
                    "mask_hidden: vLLM refuses to load it", "train it with fledge train --method peagle, or drop "
                    "parallel_drafting")
    return ok("launch.parallel_drafting", "parallel_drafting with a P-EAGLE drafter") if trained else None


def _vllm_depth(value) -> Check:
    k = _int(value)
    if k is None or k < 1:
        return fail("launch.num_tokens", f"num_speculative_tokens {value}: must be an integer >= 1",
                    '"num_speculative_tokens": 3')
    if k > MAX_USEFUL_DEPTH:
        return warn("launch.num_tokens", f"num_speculative_tokens {k}: deeper than EAGLE-3 training unrolls "
                    f"({MAX_USEFUL_DEPTH}); deep tokens are rarely accepted but each costs a draft step",
                    "measure with fledge bench; 3-5 is typical")
    return ok("launch.num_tokens", f"num_speculative_tokens {k}")


def launch_checks(cmd: str, drafter, f: DraftFacts | None, target: str | None = None) -> list[Check]:
    """Lint an SGLang or vLLM launch line against the checked drafter."""
    lc = parse_launch(cmd)
    if isinstance(lc, str):
        return [fail("launch.parse", lc, "pass the full server command in quotes: --launch \"python -m ...\"")]
    drafter = Path(drafter)
    alone = _serves_speculators_dir(lc, drafter, f)
    out = _sglang_checks(lc, drafter, f) if lc.engine == "sglang" else _vllm_checks(lc, drafter, f, alone)
    return [c for c in out + [model_check(f.verifier if alone else lc.model, drafter, f, target)] if c is not None]
