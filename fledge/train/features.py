"""What the drafter trains on: tokenized samples, the target's features for them (computed
online or read from shards written once by `fledge features`), and the target's next-token
distribution over the draft vocab.

Features of position t are the target's state after reading x_0..x_t:
    aux[t]    cat of hidden_states[i] for the canonical aux ids (conventions.py), nH wide for n
              ids (EAGLE-3 reads three)
    hidden[t] the final-norm state; the target's logits for x_{t+1} are its lm_head(hidden[t])

Shards store `hidden`, not logits. Logits over a 32K draft vocab cost 64 KB a token in bf16;
`hidden` costs 2H bytes (1.1 KB for H=576) and the target's head recomputes the logits
exactly, through the same `TargetHead.view` the online path uses — so online and offline
training see identical numbers when the shards hold fp32.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save as st_save
from tqdm import tqdm

import fledge
from fledge.core.conventions import default_aux_layer_ids, validate_aux_layer_ids
from fledge.core.devices import parse_dtype
from fledge.core.errors import FledgeError
from fledge.core.files import read_jsonl, sha256_file
from fledge.core.target import capture
from fledge.train.shards import ShardWriter, read_json_object, shard_name, verify_shards


# --------------------------------------------------------------------------- samples
@dataclass
class Sample:
    id: str
    index: int               # position among the kept samples of its file (= its feature row)
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]: x_i is a token the drafter learns to predict

    def step_counts(self, steps: int) -> torch.Tensor:
        """Trained positions per TTT step: step j at row t predicts x_{t+2+j} (see train.py)."""
        return torch.stack([self.loss_mask[2 + j:].sum() for j in range(steps)])


def load_samples(path, max_len: int, vocab_size: int) -> list[Sample]:
    """Read a tokenized training set, truncated to max_len; drop samples with nothing to train
    (the first trained prediction is x_2, so masks on x_0/x_1 alone do not count)."""
    samples = []
    for lineno, rec in read_jsonl(path):
        ids, mask = rec.get("input_ids"), rec.get("loss_mask")
        if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
            raise FledgeError(f"{path}:{lineno}: needs 'input_ids' and 'loss_mask' lists of equal length")
        bad = [t for t in ids if type(t) is not int] + [m for m in mask if type(m) not in (int, bool)]
        if bad:
            raise FledgeError(f"{path}:{lineno}: 'input_ids' and 'loss_mask' must hold integers, found {bad[0]!r}")
        ids, mask = torch.tensor(ids[:max_len], dtype=torch.int64), torch.tensor(mask[:max_len], dtype=torch.bool)
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise FledgeError(f"{path}:{lineno}: token id outside the target vocab [0, {vocab_size})")
        if mask[2:].any():
            samples.append(Sample(str(rec.get("id", lineno)), len(samples), ids, mask))
    if not samples:
        raise FledgeError(f"{path}: no sample has a loss-masked token after position 1 (max_len {max_len})")
    return samples


def loop_end(ids: torch.Tensor, mask: torch.Tensor, width: int) -> int | None:
    """Where a sample stops once its answer loops: the end of the first stretch of `width`
    trained tokens that repeats an earlier stretch of the same answer (one run of the mask),
    or None if none repeats.

    A small target's greedy answers often fall into loops (most of SmolLM2-135M's 512-token
    answers end in one), and a drafter predicts repeated text almost always right; cutting
    after the first repeat keeps one lap of each loop and spends the rest of the batch on
    text the drafter still gets wrong."""
    keys = ids.to(torch.int64).numpy().tobytes()
    trained = mask.tolist()
    start = 0
    while start < len(trained):
        if not trained[start]:
            start += 1
            continue
        end = start
        while end < len(trained) and trained[end]:
            end += 1
        seen = set()
        for i in range(start, end - width + 1):
            key = keys[8 * i: 8 * (i + width)]
            if key in seen:
                return i + width
            seen.add(key)
        start = end
    return None


def cut_loops(samples: list[Sample], width: int) -> tuple[list[Sample], dict]:
    """Each sample cut at its `loop_end`; the counts of samples cut and trained tokens kept."""
    out, cut, before, kept = [], 0, 0, 0
    for s in samples:
        before += int(s.loss_mask.sum())
        end = loop_end(s.input_ids, s.loss_mask, width)
        if end is not None:
            s, cut = Sample(s.id, s.index, s.input_ids[:end], s.loss_mask[:end]), cut + 1
        kept += int(s.loss_mask.sum())
        out.append(s)
    return out, {"samples": len(out), "cut": cut, "trained_tokens": before, "trained_tokens_kept": kept}


def padded_length(n: int, multiple: int) -> int:
    """The length a batch whose longest sample has `n` tokens is padded to (pad_batch)."""
    return -(-n // multiple) * multiple


def pad_batch(samples: list[Sample], multiple: int = 1):
    """Right-pad to the longest sample, rounded up to `multiple` so lengths fall in a few
    buckets (fewer shapes for kernels to tune for). Returns ids, loss_mask, attention_mask."""
    t = padded_length(max(len(s.input_ids) for s in samples), multiple)
    ids = torch.zeros(len(samples), t, dtype=torch.int64)
    mask = torch.zeros(len(samples), t, dtype=torch.bool)
    attn = torch.zeros(len(samples), t, dtype=torch.int64)
    for r, s in enumerate(samples):
        n = len(s.input_ids)
        ids[r, :n], mask[r, :n], attn[r, :n] = s.input_ids, s.loss_mask, 1
    return ids, mask, attn


# --------------------------------------------------------------------------- the target's side
def aux_layer_ids_for(model, aux_layer_ids=None) -> tuple[int, ...]:
    """The layers a capture of `model` reads: any number (EAGLE-3's drafter config holds it to
    three), EAGLE-3's three by default."""
    n = model.config.get_text_config().num_hidden_layers
    return validate_aux_layer_ids(aux_layer_ids, n, count=None) if aux_layer_ids else default_aux_layer_ids(n)


def feature_model(model):
    """What computes the features: the engine's compact Transformer where the family has one
    (flash attention, a few kernels a layer: the target pass of a training step costs a
    fraction of HF eager's), else the HF model itself, read through hooks. Same dtype and
    device as `model`. Online training and `fledge features` both use it, so they agree."""
    from fledge.engine.hf import COMPACT_FAMILIES, transformer_from_hf
    from fledge.engine.model import Transformer
    if not isinstance(model, Transformer) and model.config.get_text_config().model_type in COMPACT_FAMILIES:
        w = model.get_input_embeddings().weight
        return transformer_from_hf(model, w.dtype, w.device)
    return model


def online_features(model, aux_ids, ids, attn):
    """(aux [B,T,nH], hidden [B,T,H]) from one no-grad target forward over a right-padded
    batch (`model` from feature_model; `attn` marks real tokens, which never see a pad)."""
    from fledge.engine.model import Transformer
    with torch.no_grad():
        if isinstance(model, Transformer):
            hidden, aux = model.prefill(ids, aux_ids=aux_ids, hidden_only=True)
            return aux, hidden
        cap = capture(model, ids, aux_ids, attention_mask=attn)
    return cap.aux, cap.hidden


@dataclass
class TargetHead:
    """The target's output head, and where its tokens sit in the draft vocab."""
    weight: torch.Tensor        # [V, H] in the target's dtype
    bias: torch.Tensor | None
    softcap: float | None       # Gemma-style final logit soft-capping
    draft_ids: torch.Tensor     # [Vd] target id of each draft id
    to_draft: torch.Tensor      # [V] draft id of each target id, -1 outside the draft vocab

    def __post_init__(self):
        # The draft vocab's rows of the head, gathered once: a [Vd, H] matmul per batch costs
        # less than gathering Vd columns out of the V-wide logits (an index kernel over every
        # position in each training step).
        self.draft_weight = self.weight[self.draft_ids]
        self.draft_bias = None if self.bias is None else self.bias[self.draft_ids]

    @classmethod
    def from_model(cls, model, draft_ids: torch.Tensor, device) -> "TargetHead":
        head = model.get_output_embeddings()
        v = head.weight.shape[0]
        to_draft = torch.full((v,), -1, dtype=torch.int64)
        to_draft[draft_ids] = torch.arange(draft_ids.numel())
        bias = None if head.bias is None else head.bias.detach().to(device)
        return cls(head.weight.detach().to(device), bias,
                   getattr(model.config.get_text_config(), "final_logit_softcapping", None),
                   draft_ids.to(device), to_draft.to(device))

    @torch.no_grad()
    def view(self, hidden: torch.Tensor):
        """(probs [..,Vd] the target's softmax restricted to the draft vocab and renormalised,
        top [..] the draft id of the target's argmax over its FULL vocab, -1 if outside)."""
        # In the target's dtype (bf16 on the GPU), as the served target computes its logits: an
        # fp32 pass over a 49K-152K vocab would cost a large share of a training step. Stored
        # features are cast back to it, so online and offline see the same numbers.
        hidden = hidden.to(self.weight.dtype)
        top = self.to_draft[F.linear(hidden, self.weight, self.bias).argmax(-1)]  # soft-capping is monotone: same argmax
        draft = F.linear(hidden, self.draft_weight, self.draft_bias)
        if self.softcap:
            draft = torch.tanh(draft.float() / self.softcap) * self.softcap
        return draft.softmax(-1, dtype=torch.float32), top



# --------------------------------------------------------------------------- where features come from
class FeatureSource(Protocol):
    """Computes (aux [T, nH], hidden [T, H]) on the CPU for each sample, in order."""
    hidden_size: int

    def features(self, samples: list[Sample]) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def engine(self) -> dict: ...


@dataclass
class ModelFeatures:
    """The target in this process (`feature_model`), `batch_size` samples a forward."""
    model: object
    aux_ids: tuple
    batch_size: int
    device: object

    def __post_init__(self):
        self.hidden_size = self.model.get_input_embeddings().weight.shape[1]
        self.fmodel = feature_model(self.model)

    def engine(self) -> dict:
        import transformers
        return {"name": "fledge", "version": fledge.__version__, "transformers": transformers.__version__,
                "layer_ids": list(self.aux_ids), "final_state": "post-norm"}

    def features(self, samples):
        out = []
        for b in range(0, len(samples), self.batch_size):
            part = samples[b:b + self.batch_size]
            ids, _, attn = (x.to(self.device) for x in pad_batch(part))
            aux, hidden = online_features(self.fmodel, self.aux_ids, ids, attn)
            out += [(aux[r, :len(s.input_ids)].cpu(), hidden[r, :len(s.input_ids)].cpu()) for r, s in enumerate(part)]
        return out


@dataclass
class ServerFeatures:
    """A capture server (capture.VllmCapture or capture_sglang.SglangCapture)."""
    capture: object

    def __post_init__(self):
        self.hidden_size = self.capture.hidden_size

    def engine(self) -> dict:
        return self.capture.engine()

    def features(self, samples):
        return self.capture.many([s.input_ids.tolist() for s in samples])


# --------------------------------------------------------------------------- shards on disk
@dataclass(frozen=True)
class FeatureOptions:
    """How features are written: the stored dtype and samples per shard (recorded in
    meta.json, so a resumed run must keep them), and the batch size and device of an in-process
    target's forward passes (not recorded: a resumed run may change them)."""
    dtype: str = "bf16"
    shard_size: int = 256
    batch_size: int = 8
    device: str | torch.device = "cpu"

    def __post_init__(self):
        if self.shard_size < 1:
            raise FledgeError(f"--shard-size {self.shard_size}: a shard holds at least one sample")
        if self.batch_size < 1:
            raise FledgeError(f"--batch-size {self.batch_size}: must be at least 1")
        parse_dtype(self.dtype)


def write_features(model, aux_ids, samples: list[Sample], out, meta: dict, opts: FeatureOptions = FeatureOptions()) -> dict:
    """`write_source_features` from the target in this process."""
    return write_source_features(ModelFeatures(model, aux_ids, opts.batch_size, opts.device), aux_ids, samples, out,
                                 meta, opts)


def write_source_features(source: FeatureSource, aux_ids, samples: list[Sample], out, meta: dict,
                          opts: FeatureOptions) -> dict:
    """Write aux+hidden for every sample, `opts.shard_size` samples a shard (shards.py: atomic,
    listed in a manifest, so a rerun computes only what is not listed). `meta` identifies the
    data and target; a directory holding other features is refused. Returns the summary."""
    torch_dtype = parse_dtype(opts.dtype)
    meta = {**meta, "aux_layer_ids": list(aux_ids), "dtype": opts.dtype, "shard_size": opts.shard_size,
            "num_samples": len(samples), "hidden_size": source.hidden_size, "hidden": "post-norm",
            "engine": source.engine()}
    writer = ShardWriter(out, meta)
    todo = [i for i in range(math.ceil(len(samples) / opts.shard_size)) if not writer.done(i)]
    t0, tokens = time.monotonic(), 0
    total_todo = sum(len(s.input_ids) for i in todo for s in samples[i * opts.shard_size:(i + 1) * opts.shard_size])
    with tqdm(total=total_todo, desc="features", unit="tok", unit_scale=True) as bar:  # closed on errors too
        for i in todo:
            chunk = samples[i * opts.shard_size:(i + 1) * opts.shard_size]
            feats = source.features(chunk)
            lengths = torch.tensor([len(s.input_ids) for s in chunk], dtype=torch.int64)
            data = st_save({"aux": torch.cat([a for a, _ in feats]).to(torch_dtype).contiguous(),
                            "hidden": torch.cat([h for _, h in feats]).to(torch_dtype).contiguous(), "lengths": lengths})
            writer.write(i, data, len(chunk))
            tokens += int(lengths.sum())
            bar.update(int(lengths.sum()))
    seconds = time.monotonic() - t0
    total = sum(len(s.input_ids) for s in samples)
    return {"samples": len(samples), "tokens": total, "tokens_this_run": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1) if tokens and seconds > 0 else None,
            "bytes_on_disk": writer.bytes_on_disk(), "bytes_per_token": round(writer.bytes_on_disk() / total, 1)}


def read_meta(root: Path) -> dict:
    if not (root / "meta.json").exists():
        raise FledgeError(f"{root}: no meta.json (not a `fledge features` directory)")
    meta = read_json_object(root / "meta.json", "meta.json")
    for k in ("num_samples", "shard_size", "hidden_size", "aux_layer_ids"):
        if k not in meta:
            raise FledgeError(f"{root / 'meta.json'}: no {k!r}")
    if meta.get("hidden", "post-norm") != "post-norm":
        raise FledgeError(f"{root / 'meta.json'}: 'hidden' holds {meta['hidden']!r} states; training needs the final-norm state")
    return meta


class FeatureStore:
    """Random access to the features of sample i, read lazily from its shard. Every shard is
    checked against the manifest (and `lengths`, each sample's token count) before training."""

    def __init__(self, root, expect: dict, hidden_size: int, lengths: list[int] | None = None):
        self.root = Path(root)
        self.meta = read_meta(self.root)
        for k, v in expect.items():
            if self.meta.get(k) != v:
                raise FledgeError(f"{self.root}: features were made with {k}={self.meta.get(k)!r}, this run has {v!r}")
        n_shards = math.ceil(self.meta["num_samples"] / self.meta["shard_size"])
        verify_shards(self.root, n_shards, self.meta["shard_size"], lengths)
        self._open: dict[int, tuple] = {}
        aux, hidden, _ = self._shard(0)
        n = len(self.meta["aux_layer_ids"])
        if hidden.get_shape()[-1] != hidden_size or aux.get_shape()[-1] != n * hidden_size:
            raise FledgeError(f"{self.root}: feature widths aux {aux.get_shape()[-1]}, hidden {hidden.get_shape()[-1]}; "
                              f"{n} aux layers of the target need {n}xH={n * hidden_size} and H={hidden_size}")

    def _shard(self, i):
        if i not in self._open:
            f = safe_open(str(self.root / shard_name(i)), "pt")
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), f.get_tensor("lengths").cumsum(0)])
            self._open[i] = (f.get_slice("aux"), f.get_slice("hidden"), offsets, f)
        return self._open[i][:3]

    def get(self, i: int):
        aux, hidden, off = self._shard(i // self.meta["shard_size"])
        r = i % self.meta["shard_size"]
        a, b = int(off[r]), int(off[r + 1])
        return aux[a:b], hidden[a:b]

    def prefetch(self, indices) -> None:
        """Nothing to do: shards are read when a batch needs them."""

    def batch(self, indices, t: int, device):
        """Padded (aux [B,t,nH], hidden [B,t,H]) in fp32 on `device`."""
        return pad_features([self.get(i) for i in indices], t, self.meta["hidden_size"], device)


def pad_features(feats, t: int, hidden_size: int, device):
    out_a = torch.zeros(len(feats), t, feats[0][0].shape[-1])
    out_h = torch.zeros(len(feats), t, hidden_size)
    for r, (a, h) in enumerate(feats):
        out_a[r, :len(a)], out_h[r, :len(h)] = a.float(), h.float()
    return out_a.to(device), out_h.to(device)


def features_meta(target_name: str, data_path, max_len: int) -> dict:
    """What makes two feature directories interchangeable: the target, the data, the cut."""
    return {"target": target_name, "data_sha": sha256_file(data_path)[:16], "max_len": max_len}


def summary_line(s: dict, out) -> str:
    rate = f", {s['tokens_per_s']:,} tokens/s" if s["tokens_per_s"] else ""
    return (f"{s['samples']} samples, {s['tokens']:,} tokens{rate}, {s['bytes_per_token']:,} bytes/token "
            f"({s['bytes_on_disk'] / 2**30:.2f} GiB) in {out}")
