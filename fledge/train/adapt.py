"""`fledge adapt`: retarget a trained drafter (OLD) to a new version of its target (NEW).

Most of a drafter does not depend on the target's exact weights: fc, the decoder layer and the
final norm read hidden states of the same width and roughly the same meaning, so they are
carried. What is indexed by tokens changes: the embeddings (always NEW's, frozen) and, with
`--rebuild-vocab`, the draft vocabulary and its lm_head rows.

OLD's draft vocabulary is kept by default: it was counted on OLD's whole training set, adapt's
data is usually far smaller, and a vocab rebuilt from a few samples swaps thousands of
well-trained rows for guesses (12 samples replaced 5,962 of the 16,384 tokens of a SmolLM2
drafter).

lm_head rows are matched by TARGET token id, never by draft index (two vocabularies put one
token at different indices). A token in both vocabularies keeps OLD's trained row. A token only
NEW's has starts from NEW's own lm_head row for it, rescaled to the median norm of the carried
rows (of all OLD's rows if none is carried). Why: the draft's head is trained to imitate the
target's restricted to the draft vocab, reading the same residual space, so the target's row
points the right way; but its scale follows the target's final-norm gain, not the draft's, and
a row much larger than the rest would win every argmax until trained. Token ids are assumed to
mean the same token in both tokenizers (a new version of one model family); ids past OLD's
vocabulary count as new.

The initialised drafter is written to <out>/init (fp32: nothing is rounded before fine-tuning)
and fine-tuned on NEW with `fledge train --init` into <out>/train, resumably; the final drafter
is <out>/train/draft. Training is single-process here: for several GPUs run
`fledge adapt --no-train`, then `torchrun ... fledge train --init <out>/init`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fledge.core.config import ADAPT_TRAIN_OPTIONS, DraftConfig, check_number
from fledge.core.conventions import diff_vocab, validate_aux_layer_ids
from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json, check_no_overlap, output_lock
from fledge.core.report import print_table
from fledge.data.tokenize import check_tokenized
from fledge.data.vocab import count_masked_tokens, top_target_ids
from fledge.drafter.checkpoint import export_checkpoint, load_checkpoint, verifier_of
from fledge.drafter.eagle3 import Eagle3Draft
from fledge.drafter.layout import draft_facts
from fledge.drafter.weights import open_checkpoint

# Tensors that do not depend on the target's tokens: carried from OLD unchanged.
CARRIED_PREFIXES = ("fc_norm.", "fc.", "midlayer.", "layers.", "norm.")


@dataclass
class AdaptConfig:
    drafter: str                  # OLD's exported drafter directory (any layout fledge reads)
    target: str                   # NEW target spec (HF dir, GGUF, built-in name)
    data: str                     # tokenized training set made with NEW
    out: str
    draft_vocab: int | None = None  # with rebuild_vocab; default: OLD's draft vocab size
    rebuild_vocab: bool = False   # build the draft vocab from `data` instead of keeping OLD's
    train: bool = True
    train_options: dict = field(default_factory=dict)  # TrainConfig fields

    def __post_init__(self):
        for name in ("drafter", "data"):
            if not Path(getattr(self, name)).exists():
                raise FledgeError(f"--{name} {getattr(self, name)}: does not exist")
        if self.draft_vocab is not None:
            check_number("--draft-vocab", self.draft_vocab, 1, integer=True, what="adapt")
        if self.draft_vocab is not None and not self.rebuild_vocab:
            raise FledgeError("--draft-vocab sets the size of a rebuilt vocab: add --rebuild-vocab "
                              "(without it adapt keeps OLD's draft vocab)")
        inputs = {"--drafter": self.drafter, "--data": self.data, "--eval-data": self.train_options.get("eval_data"),
                  "--features": self.train_options.get("features")}
        for written in ("init", "train", "adapt.json"):  # init is replaced on every run
            check_no_overlap(Path(self.out) / written, inputs)


# --------------------------------------------------------------------------- the adaptation
def load_old(path, new_num_layers: int) -> Eagle3Draft:
    """OLD's drafter (its embeddings are not needed: NEW's replace them). A checkpoint that does
    not record its target's depth (SpecForge, AQ-MedAI) is read as made for NEW's depth."""
    config = open_checkpoint(path).config  # None: load_checkpoint says why
    recorded = config and draft_facts(config).target_layers
    return load_checkpoint(path, target_layers=None if recorded else new_num_layers)


def new_config(old: DraftConfig, new_tcfg, draft_vocab: int) -> DraftConfig:
    """The drafter's config for NEW: NEW's geometry and context, OLD's MLP width and layers
    (EAGLE-3 or 3.1, and their count), OLD's aux ids if NEW has those layers (else NEW's defaults). Refuses what
    cannot carry OLD's weights."""
    if old.parallel:  # its mask token is an id of OLD's tokenizer, which NEW's need not share
        raise FledgeError("--drafter is a P-EAGLE drafter (ptd_token_id): adapt carries EAGLE-3 drafters; adapt "
                          "the EAGLE-3 drafter it started from, then `fledge train --method peagle --init` on NEW")
    n = new_tcfg.num_hidden_layers
    try:
        aux = validate_aux_layer_ids(old.aux_layer_ids, n)
    except FledgeError:
        aux = None
    cfg = DraftConfig.from_target(new_tcfg, draft_vocab_size=draft_vocab, aux_layer_ids=aux,
                                  intermediate_size=old.intermediate_size)
    geometry = ("hidden_size", "target_hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    for name in geometry:
        if getattr(old, name) != getattr(cfg, name):
            raise FledgeError(f"--target: {name} {getattr(cfg, name)} but the drafter has {getattr(old, name)}; "
                              "adapt carries weights only between targets of one width and head layout")
    cfg.extra = {k: v for k, v in old.extra.items() if k == "speculative_tokens"}
    return cfg.replace(fc_norm=old.fc_norm, norm_output=old.norm_output, num_hidden_layers=old.num_hidden_layers)


def head_rows(old: Eagle3Draft, new_head: torch.Tensor, new_ids: torch.Tensor):
    """lm_head [len(new_ids), H] for NEW's vocab (module doc) and a bool mask of carried rows."""
    old_ids, old_w = old.target_ids().cpu(), old.lm_head.weight.detach().float().cpu()
    old_row = torch.full((max(int(old_ids.max()), int(new_ids.max())) + 1,), -1, dtype=torch.int64)
    old_row[old_ids] = torch.arange(old_ids.numel())
    src = old_row[new_ids]
    carried = src >= 0
    rows = new_head[new_ids].detach().float().cpu()
    scale_from = old_w[src[carried]] if carried.any() else old_w
    target_norm = scale_from.norm(dim=1).median()
    rows = rows * (target_norm / rows.norm(dim=1, keepdim=True).clamp_min(1e-12))
    rows[carried] = old_w[src[carried]]
    return rows, carried


def adapt_draft(old: Eagle3Draft, new_model, new_ids: torch.Tensor) -> tuple[Eagle3Draft, dict]:
    """A drafter for `new_model` over the draft vocab `new_ids` (ascending target ids) carrying
    OLD's weights as the module doc says; returns it (fp32, CPU) and a report."""
    tcfg = new_model.config.get_text_config()
    cfg = new_config(old.cfg, tcfg, new_ids.numel())
    draft = Eagle3Draft.from_target(cfg, new_model, new_ids)
    old_sd, sd = old.state_dict(), draft.state_dict()
    carried = [k for k in sd if k.startswith(CARRIED_PREFIXES)]
    for k in carried:
        if old_sd[k].shape != sd[k].shape:
            raise FledgeError(f"--drafter: {k} has shape {list(old_sd[k].shape)}, NEW needs {list(sd[k].shape)}")
    rows, kept = head_rows(old, new_model.get_output_embeddings().weight, new_ids)
    with torch.no_grad():
        for k in carried:
            sd[k].copy_(old_sd[k])
        draft.lm_head.weight.copy_(rows)
    report = {"vocab": diff_vocab(old.target_ids(), new_ids),
              "target_vocab": {"old": old.cfg.vocab_size, "new": cfg.vocab_size},
              "lm_head_rows": {"carried": int(kept.sum()), "initialised": int((~kept).sum())},
              "tensors_carried": carried, "tensors_from_new_target": ["embed_tokens.weight"],
              "aux_layer_ids": {"old": list(old.cfg.aux_layer_ids), "new": list(cfg.aux_layer_ids),
                                "kept": cfg.aux_layer_ids == old.cfg.aux_layer_ids},
              "target_layers": {"old": old.cfg.target_num_layers, "new": cfg.target_num_layers}}
    return draft, report


def choose_vocab(cfg: AdaptConfig, old: Eagle3Draft, counts: torch.Tensor) -> tuple[torch.Tensor, dict, list[str]]:
    """(NEW's draft vocab as ascending target ids, what was decided, warnings): OLD's vocab
    unless `cfg.rebuild_vocab`, else the top tokens of --data's loss-masked `counts`."""
    old_ids, vocab = old.target_ids().cpu(), counts.numel()
    total = max(1, int(counts.sum()))
    seen = int((counts > 0).sum())
    note = {"rebuilt": cfg.rebuild_vocab, "distinct_data_tokens": seen, "data_tokens": int(counts.sum())}
    if not cfg.rebuild_vocab:
        if int(old_ids.max()) >= vocab:
            raise FledgeError(f"OLD's draft vocab holds target ids up to {int(old_ids.max())}, NEW's vocab has "
                              f"{vocab}: the tokenizers differ; add --rebuild-vocab")
        return old_ids, {**note, "data_coverage": float(counts[old_ids].sum()) / total}, []
    n = cfg.draft_vocab or old.cfg.draft_vocab_size
    if not 0 < n <= vocab:
        raise FledgeError(f"--draft-vocab {n}: must be in [1, {vocab}] (NEW's vocab)")
    new_ids = top_target_ids(counts, n)
    note.update(data_coverage=float(counts[new_ids].sum()) / total,
                old_data_coverage=float(counts[old_ids[old_ids < vocab]].sum()) / total)
    warnings = []
    if seen < n:
        warnings.append(f"--data shows {seen:,} distinct loss-masked tokens, fewer than the {n:,}-token draft vocab: "
                        f"{n - seen:,} slots hold ids it never saw, so the rebuilt vocab is mostly guesswork; "
                        "drop --rebuild-vocab to keep OLD's, or adapt on more data")
    return new_ids, note, warnings


def heldout(rec: dict | None) -> dict | None:
    """The held-out figures of a `fledge train` eval record that the adapt report keeps."""
    if not rec:
        return None
    keep = {"accept_len": rec["accept_len"], "acc0": rec["acc"][0], "loss0": rec["loss"][0]}
    return {**keep, **({"replay_accept_len": rec["replay_accept_len"]} if "replay_accept_len" in rec else {})}


# --------------------------------------------------------------------------- the step
def adapt(cfg: AdaptConfig, target) -> dict:
    """Build NEW's vocab, adapt OLD to it, write <out>/init, fine-tune into <out>/train
    (resuming); returns the report, also written to <out>/adapt.json."""
    out = Path(cfg.out)
    # What the init depends on; train options are checked by train's own resume key.
    args = {k: getattr(cfg, k) for k in ("drafter", "target", "data", "draft_vocab", "rebuild_vocab")}
    previous = out / "adapt.json"
    if previous.exists() and json.loads(previous.read_text()).get("args") != args:
        raise FledgeError(f"{out}: holds an adapt run with other arguments; use a new --out")
    model, tcfg = target.model, target.model.config.get_text_config()
    check_tokenized(cfg.data, target.tokenizer, target.name)
    old = load_old(cfg.drafter, tcfg.num_hidden_layers)
    new_config(old.cfg, tcfg, cfg.draft_vocab or old.cfg.draft_vocab_size)  # refuses before the pass over the data
    ids, vocab_note, warnings = choose_vocab(cfg, old, count_masked_tokens(cfg.data, tcfg.vocab_size))
    for w in warnings:
        print(f"fledge adapt: warning: {w}", file=sys.stderr)
    draft, report = adapt_draft(old, model, ids)
    report["vocab"].update(vocab_note)
    draft.cfg.extra["verifier"] = verifier_of(target)
    # Deterministic, so a rerun (resuming the fine-tune) rewrites it identically.
    export_checkpoint(draft, out / "init", dtype=torch.float32, overwrite=True)
    report = {"args": args, **report, "warnings": warnings, "init": str(out / "init")}
    atomic_write_json(previous, report)
    if cfg.train:
        from fledge.train.loop import TrainConfig, train
        from fledge.train.run import (  # the training loop is only needed here
            evaluate,
            setup,
        )
        tc = TrainConfig(**{**cfg.train_options, "data": cfg.data, "out": str(out / "train"),
                            "target": cfg.target, "init": str(out / "init")})
        run = setup(tc, target)  # the initialised drafter on the held-out samples train will evaluate
        before = heldout(evaluate(run)) if run.evals else None
        del run
        report["train"] = train(tc, target)
        report["heldout"] = {"before": before, "after": heldout(report["train"]["eval"])}
        atomic_write_json(previous, report)
    return report


def print_report(report: dict) -> None:
    v, rows, aux = report["vocab"], report["lm_head_rows"], report["aux_layer_ids"]
    aux_note = "" if aux["kept"] else " (NEW default)"
    if v["rebuilt"]:
        how = (f"rebuilt from --data: {v['only_b']:,} of {v['size_b']:,} tokens replaced; --data coverage "
               f"{v['old_data_coverage']:.3f} (old) -> {v['data_coverage']:.3f} (new)")
    else:
        how = f"OLD's kept (--rebuild-vocab to rebuild); covers {v['data_coverage']:.3f} of --data's tokens"
    table = [["draft vocab", how],
             ["draft vocab size (old → new)", f"{v['size_a']} → {v['size_b']}"],
             ["tokens in both / only old / only new", f"{v['overlap']} / {v['only_a']} / {v['only_b']}"],
             ["d2t entries that differ", v["entries_differ"]],
             ["distinct tokens in --data", f"{v['distinct_data_tokens']:,} of {v['data_tokens']:,} loss-masked"],
             ["target vocab (old → new)", f"{report['target_vocab']['old']} → {report['target_vocab']['new']}"],
             ["lm_head rows carried / initialised", f"{rows['carried']} / {rows['initialised']}"],
             ["tensors carried", len(report["tensors_carried"])],
             ["aux layer ids (canonical)", f"{aux['old']} → {aux['new']}{aux_note}"],
             ["initialised drafter", report["init"]]]
    if report.get("train"):
        table.append(["fine-tuned drafter", report["train"]["draft"]])
    h = report.get("heldout") or {}
    if h.get("before") and h.get("after"):
        b, a = h["before"], h["after"]
        table.append(["held-out accept length, SGLang's (before → after)", f"{b['accept_len']:.3f} → {a['accept_len']:.3f}"])
        table.append(["held-out step-0 accuracy (before → after)", f"{b['acc0']:.3f} → {a['acc0']:.3f}"])
        table.append(["held-out step-0 soft CE (before → after)", f"{b['loss0']:.4f} → {a['loss0']:.4f}"])
    print_table(table)
    for w in report.get("warnings", []):
        print(f"warning: {w}")


def run_adapt(args) -> int:
    from fledge.core.target import load_target
    opts = {name.replace("-", "_"): getattr(args, name.replace("-", "_")) for name, _, _ in ADAPT_TRAIN_OPTIONS}
    opts.update(device=args.device, eval_data=args.eval_data, features=args.features, bf16=args.bf16)
    cfg = AdaptConfig(drafter=args.drafter, target=args.target, data=args.data, out=args.out,
                      draft_vocab=args.draft_vocab, rebuild_vocab=args.rebuild_vocab, train=args.train,
                      train_options={k: v for k, v in opts.items() if v is not None})
    with output_lock(cfg.out):  # one adapt per run directory
        report = adapt(cfg, load_target(cfg.target))
    if (report.get("train") or {}).get("eval"):
        from fledge.train.loop import print_eval
        print_eval(report["train"]["eval"])
    print_report(report)
    print(f"wrote {Path(cfg.out) / 'adapt.json'}")
    return 0
