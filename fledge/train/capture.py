"""The target's features from a running vLLM server, for targets one process cannot hold.

vLLM's `extract_hidden_states` speculative method keeps the states of the layers it is told
(`eagle_aux_hidden_state_layer_ids`, vLLM's numbering, which is fledge's canonical one: id L is
HF `hidden_states[L]`) and a KV connector writes each finished request's states to a file on
the server's disk. Per sample the client sends the token ids with max_tokens=1, checks the ids
the server reports, reads the file the reply names and deletes it.

Traps handled here: vLLM's last captured layer (id N) is the state *before* the final norm, so
fledge applies the norm itself, its weight read from the target's checkpoint alone; prefix
caching or chunked prefill would leave states short, so a short file is refused; only TP rank 0
writes, and the connector writes each request once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from fledge.core.errors import FledgeError
from fledge.core.openai_client import Client, ServerError, with_retries

CONNECTOR = "CPUHiddenStatesConnector"
CONNECTOR_MODULE = "fledge.train.vllm_connector"
# Families whose final norm is x / rms(x) * w; Gemma's is x / rms(x) * (1 + w).
PLAIN_RMSNORM = {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2",
                 "kimi_k2", "glm4_moe", "mixtral", "phi3", "olmo2"}
GEMMA_RMSNORM = {"gemma", "gemma2", "gemma3", "gemma3_text"}


# --------------------------------------------------------------------------- the final norm
@dataclass
class FinalNorm:
    """The target's final RMSNorm, read from its config and checkpoint without loading the model."""
    weight: torch.Tensor  # [H] fp32, (1 + w) already folded in for Gemma
    eps: float

    @classmethod
    def from_target_dir(cls, path: Path) -> "FinalNorm":
        cfg = transformers.AutoConfig.from_pretrained(path).get_text_config()
        family = cfg.model_type
        if family not in PLAIN_RMSNORM | GEMMA_RMSNORM:
            raise FledgeError(f"{path}: fledge does not know how a {family!r} target applies its final norm; "
                              "capture from a server is supported for " + ", ".join(sorted(PLAIN_RMSNORM | GEMMA_RMSNORM)))
        w = norm_weight(path).float()
        return cls(w + 1 if family in GEMMA_RMSNORM else w, float(cfg.rms_norm_eps))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def norm_weight(path: Path) -> torch.Tensor:
    """The final norm's weight: the one `*norm.weight` tensor outside the decoder layers (and
    any vision tower) of the checkpoint's safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        where = json.loads(index.read_text())["weight_map"]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FledgeError(f"{path}: no safetensors checkpoint to read the final norm from")
        with safe_open(str(files[0]), "pt") as f:
            where = {k: files[0].name for k in f.keys()}
    keys = [k for k in where if k.endswith("norm.weight") and ".layers." not in k
            and not any(s in k for s in ("vision", "visual", "mtp", "draft"))]
    if len(keys) != 1:
        raise FledgeError(f"{path}: cannot tell the final norm's weight among {keys or 'no *norm.weight tensors'}")
    with safe_open(str(path / where[keys[0]]), "pt") as f:
        return f.get_tensor(keys[0])


# --------------------------------------------------------------------------- launching
def engine_layer_ids(aux_ids, num_layers: int) -> list[int]:
    """The layers vLLM captures, in its numbering: the aux ids, then N (the last layer's
    output before the final norm)."""
    return [*aux_ids, num_layers]


def launch_args(target: Path, name: str, aux_ids, num_layers: int, storage: Path, max_model_len: int) -> list[str]:
    """The vLLM arguments of a capture server (after `vllm serve` or the api_server module)."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": engine_layer_ids(aux_ids, num_layers)}}}
    kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return [str(target), "--served-model-name", name, "--max-model-len", str(max_model_len),
            "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
            "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]


def launch_line(args: list[str]) -> str:
    package_root = Path(__file__).resolve().parents[2]
    return f"PYTHONPATH={shlex.quote(str(package_root))} vllm serve " + " ".join(shlex.quote(a) for a in args)


# --------------------------------------------------------------------------- capturing
@dataclass
class ServerCapture:
    """What every engine's capture client holds: the server, the target's shape and the limits
    of its requests. A subclass gives `engine` (what meta.json records of the server, after
    checking it serves `model`) and `one` (the aux and final states of one sequence)."""
    url: str
    model: str              # the served model name
    aux_ids: tuple          # canonical
    num_layers: int
    hidden_size: int
    norm: FinalNorm         # applied where the engine returns the pre-norm state
    timeout: float = 600.0
    retries: int = 3
    concurrency: int = 4

    def __post_init__(self):
        if self.concurrency < 1 or self.retries < 0 or self.timeout <= 0:
            raise FledgeError("capture needs --concurrency >= 1, --retries >= 0 and --timeout > 0")
        self.client = Client(self.url, self.timeout)

    def many(self, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`one` for each sequence, `concurrency` in flight, results in order."""
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self.one, seqs))


class VllmCapture(ServerCapture):
    """Features of token-id sequences from one vLLM capture server (`launch_args`)."""

    def engine(self) -> dict:
        """What meta.json records of the engine; also checks the server serves `model`."""
        try:
            names = with_retries(lambda k: self.client.models(), self.retries, 1.0)
        except ServerError as e:
            raise FledgeError(f"{self.url}: cannot reach the capture server ({e.problem})") from None
        if self.model not in names:
            raise FledgeError(f"{self.url} serves {names}, not {self.model!r}: a server for another model "
                              "(or pass --served-name)")
        version = "unknown"
        try:
            version = str(self.client.root_json("/version").get("version", "unknown"))
        except (ServerError, AttributeError):
            pass  # a proxy in front may not pass /version through; the name is what is checked
        return {"name": "vllm", "version": version, "layer_ids": engine_layer_ids(self.aux_ids, self.num_layers),
                "final_state": "pre-norm; fledge applied the target's final norm"}

    def one(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [T, 3H], hidden [T, H]) of one sample, the final norm applied."""
        return self.read_states(self.request(ids), ids)

    def request(self, ids: list[int]) -> Path:
        """Send one sample; the path of the file the server writes its states to."""
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}
        try:
            reply = with_retries(lambda k: self.client.completion(body), self.retries, 1.0)
        except ServerError as e:
            raise FledgeError(f"{self.url}: capture request failed ({e.problem}{': ' + e.detail[:200] if e.detail else ''})") from None
        params = reply.get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        if not path:
            raise FledgeError(f"{self.url}: the reply names no hidden-states file; start the server with "
                              "--speculative-config extract_hidden_states and the hidden-states connector "
                              "(`fledge features --print-launch`)")
        sent = (reply.get("choices") or [{}])[0].get("prompt_token_ids")
        if sent is not None and sent != ids:
            raise FledgeError(f"{self.url}: the server read other token ids than were sent ({len(sent)} vs {len(ids)})")
        return Path(path)

    def read_states(self, path: Path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        states, token_ids, layers = read_and_remove(path)
        want = engine_layer_ids(self.aux_ids, self.num_layers)
        if layers is not None and layers != want:
            raise FledgeError(f"{self.url}: the server captures layers {layers}, these features need {want} "
                              f"(aux {list(self.aux_ids)} and {self.num_layers}); restart it with the launch line "
                              "of `fledge features --print-launch`")
        if states.dim() != 3 or states.shape[1:] != (len(want), self.hidden_size):
            raise FledgeError(f"{path}: states of shape {list(states.shape)}, expected [T, {len(want)}, {self.hidden_size}] "
                              "(another model, or other captured layers)")
        if states.shape[0] != len(ids) or token_ids.tolist() != ids:
            raise FledgeError(f"{path}: states for {states.shape[0]} tokens, the sample has {len(ids)}: start the server "
                              "with --no-enable-prefix-caching and --no-enable-chunked-prefill")
        aux = states[:, :-1].reshape(len(ids), -1)
        return aux, self.norm(states[:, -1])

def read_and_remove(path: Path) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
    """(hidden_states [T, layers, H], token_ids [T], layer ids or None) of a connector's file,
    waiting on its lock while the server still writes; the file and lock are removed after."""
    lock = Path(f"{path}.lock")
    try:
        if lock.exists():
            with open(lock) as lf:
                fcntl.flock(lf, fcntl.LOCK_SH)  # the writer holds LOCK_EX until the file is whole
        data = load_file(str(path))
    except FileNotFoundError:
        raise FledgeError(f"{path}: the server's hidden-states file is not here; capture must run on a machine "
                          "that sees the server's shared_storage_path") from None
    except (SafetensorError, OSError) as e:
        raise FledgeError(f"{path}: unreadable hidden-states file ({e})") from None
    for f in (path, lock):
        with contextlib.suppress(FileNotFoundError):
            os.remove(f)
    if "hidden_states" not in data or "token_ids" not in data:
        raise FledgeError(f"{path}: no hidden_states/token_ids tensors (not a hidden-states connector's file)")
    layers = data["layer_ids"].tolist() if "layer_ids" in data else None
    return data["hidden_states"], data["token_ids"], layers
