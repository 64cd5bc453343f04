"""`fledge vocab`: the draft vocabulary (d2t/t2d) from loss-masked token frequencies, its
coverage on held-out data, and how two drafters' vocabularies differ.

The draft vocab is the N target tokens the drafter is trained to predict most often (tokens at
loss_mask 1), ties broken by the lower target id, ids unseen in training filling any shortfall
in ascending order: the same data always gives the same vocab. Coverage — the share of
held-out trained tokens inside the vocab — bounds per-token acceptance: a token outside the
draft vocab can never be drafted.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save as st_save
from tqdm import tqdm

from fledge.core.conventions import (
    d2t_from_target_ids,
    diff_vocab,
    t2d_from_target_ids,
    target_ids_from_d2t,
)
from fledge.core.errors import FledgeError
from fledge.core.files import (
    atomic_write_bytes,
    atomic_write_json,
    check_no_overlap,
    keeping,
    output_lock,
    read_jsonl,
)
from fledge.core.report import print_table
from fledge.drafter.weights import model_config, open_checkpoint, scan_files


def _masked_tokens(record, path, lineno) -> torch.Tensor:
    """The trained tokens of one sample; ids must be integers and the mask 0/1, of one length.
    (torch.tensor with no dtype keeps what the JSON held: a float id stays float and is
    refused here rather than rounded to some other token.)"""
    where = f"{path}:{lineno}"
    if not isinstance(record, dict) or "input_ids" not in record or "loss_mask" not in record:
        raise FledgeError(f"{where}: not a tokenized sample (input_ids, loss_mask); "
                          f"give the *.tok.jsonl that `fledge prep --tokenizer` writes")
    try:
        ids, mask = torch.tensor(record["input_ids"]), torch.tensor(record["loss_mask"])
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise FledgeError(f"{where}: input_ids and loss_mask must be lists of integers") from None
    if ids.ndim != 1 or mask.ndim != 1 or ids.numel() != mask.numel():
        raise FledgeError(f"{where}: input_ids and loss_mask must be flat lists of one length")
    if ids.numel() and ids.dtype != torch.int64:
        raise FledgeError(f"{where}: input_ids hold {ids.dtype} values, not integer token ids")
    if mask.numel() and not (mask.dtype in (torch.int64, torch.bool) and ((mask == 0) | (mask == 1)).all()):
        raise FledgeError(f"{where}: loss_mask must hold only 0 and 1")
    return ids.to(torch.int64)[mask.to(torch.bool)]


def _check_input(path) -> None:
    path = Path(path)
    if not path.exists():
        raise FledgeError(f"{path}: no such file (a tokenized JSONL from `fledge prep --tokenizer`)")
    if path.is_dir():
        raise FledgeError(f"{path}: is a directory; give its tokenized JSONL (e.g. train.tok.jsonl)")


def _records(path):
    """(lineno, record) of a tokenized JSONL, with the ways reading it can fail as one line."""
    _check_input(path)
    try:
        yield from read_jsonl(path)
    except UnicodeDecodeError:
        raise FledgeError(f"{path}: not UTF-8 text; not a tokenized JSONL") from None
    except RecursionError:
        raise FledgeError(f"{path}: JSON nested too deeply; not a tokenized JSONL") from None


def count_masked_tokens(dataset_path, target_vocab: int, empty: list | None = None) -> torch.Tensor:
    """Counts [target_vocab] of the tokens at loss_mask 1 in a tokenized training set.
    `empty`, when given, collects the line numbers of samples with no trained token."""
    counts = torch.zeros(target_vocab, dtype=torch.int64)
    pending = []

    def flush():
        toks = torch.cat(pending)
        if toks.numel() and (toks.min() < 0 or toks.max() >= target_vocab):
            raise FledgeError(f"{dataset_path}: token ids outside [0, {target_vocab}): wrong target vocab?")
        counts.add_(torch.bincount(toks, minlength=target_vocab))
        pending.clear()

    for lineno, rec in tqdm(_records(dataset_path), desc=f"count {Path(dataset_path).name}", unit="sample"):
        pending.append(_masked_tokens(rec, dataset_path, lineno))
        if empty is not None and not pending[-1].numel():
            empty.append(lineno)
        if len(pending) == 1024:  # one bincount per batch: per-record ones cost a vocab-sized add each
            flush()
    if pending:
        flush()
    return counts


def _as_counts(token_counts_or_dataset, target_vocab: int) -> torch.Tensor:
    x = token_counts_or_dataset
    if isinstance(x, (str, Path)):
        return count_masked_tokens(x, target_vocab)
    if isinstance(x, Mapping):
        counts = torch.zeros(target_vocab, dtype=torch.int64)
        for tok, n in x.items():
            if not 0 <= int(tok) < target_vocab:
                raise FledgeError(f"token id {tok} outside [0, {target_vocab})")
            counts[int(tok)] = int(n)
        return counts
    counts = torch.as_tensor(x, dtype=torch.int64).flatten()
    if counts.numel() != target_vocab:
        raise FledgeError(f"token counts have {counts.numel()} entries, target vocab is {target_vocab}")
    return counts


def top_target_ids(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The draft vocab's target ids, ascending: top-N by count, ties to the lower id."""
    if not 0 < draft_vocab_size <= counts.numel():
        raise FledgeError(f"draft vocab size {draft_vocab_size} must be in [1, {counts.numel()}]")
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: ties keep id order
    return torch.sort(order[:draft_vocab_size]).values


def build_vocab(token_counts_or_dataset, target_vocab: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from a tokenized dataset path, a {token: count} mapping or a dense count
    vector over the target vocab."""
    ids = top_target_ids(_as_counts(token_counts_or_dataset, target_vocab), draft_vocab_size)
    return d2t_from_target_ids(ids, target_vocab), t2d_from_target_ids(ids, target_vocab)


def coverage(target_ids, dataset_path) -> float:
    """Share of the loss-masked tokens in a tokenized set that the draft vocab contains."""
    ids = torch.as_tensor(target_ids, dtype=torch.int64)
    inside = t2d_from_target_ids(ids, int(ids.max()) + 1)
    hit = total = 0
    for lineno, rec in _records(dataset_path):
        toks = _masked_tokens(rec, dataset_path, lineno)
        total += toks.numel()
        toks = toks[(toks >= 0) & (toks < inside.numel())]
        hit += int(inside[toks].sum())
    if total == 0:
        raise FledgeError(f"{dataset_path}: no loss-masked tokens to measure coverage on")
    return hit / total


# --------------------------------------------------------------------------- files
def save_vocab(path, target_ids: torch.Tensor, target_vocab: int, stats: dict) -> None:
    """safetensors {d2t, t2d} plus `<path>.json` with the stats."""
    tensors = {"d2t": d2t_from_target_ids(target_ids, target_vocab),
               "t2d": t2d_from_target_ids(target_ids, target_vocab)}
    atomic_write_bytes(path, st_save(tensors))
    atomic_write_json(Path(path).with_suffix(".json"), stats)


def load_vocab_ids(path) -> tuple[torch.Tensor, int]:
    """(target ids, target vocab) from a vocab file or a drafter checkpoint directory."""
    path = Path(path)
    if path.is_dir():
        ck = open_checkpoint(path)
        w, config, problems, base = ck.weights, ck.config, [] if ck.weights else ck.fails, path
    elif path.is_file():
        (w, problems), config, base = scan_files([path]), None, path.parent
    else:
        raise FledgeError(f"{path}: no vocab file or drafter checkpoint directory")
    if problems:
        raise FledgeError(f"{base}/{problems[-1]}")
    if "d2t" not in w.files:
        raise FledgeError(f"{path}: no d2t tensor")
    if "t2d" in w.files:
        target_vocab = w.read("t2d").size
    elif config and "vocab_size" in config:
        target_vocab = config["vocab_size"]
    else:
        raise FledgeError(f"{path}: no t2d and no config.json to tell the target vocab size")
    return torch.from_numpy(target_ids_from_d2t(w.read("d2t"), target_vocab)), target_vocab


def _target_vocab(args) -> int:
    if args.target_vocab:
        return args.target_vocab
    if not args.target:
        raise FledgeError("give --target-vocab N or --target DIR (an HF dir with config.json)")
    from fledge.core.target import resolve_target

    return int(model_config(resolve_target(args.target))["vocab_size"])


# --------------------------------------------------------------------------- CLI
def _print_rows(rows) -> None:
    print_table([[k, v if not isinstance(v, float) else f"{v:.4f}"] for k, v in rows])


def _check_outputs(args) -> None:
    out = Path(args.out)
    for path in (out, out.with_suffix(".json")):
        if path.is_dir():
            raise FledgeError(f"-o {args.out}: {path} is a directory; give a .safetensors file name")
        check_no_overlap(path, {"dataset": args.dataset, "--heldout": args.heldout})


def run_build(args) -> int:
    _check_input(args.dataset)
    if args.heldout:
        _check_input(args.heldout)
    _check_outputs(args)
    with output_lock(args.out):  # one writer per vocab file
        return _build(args)


def _build(args) -> int:
    target_vocab = _target_vocab(args)
    if args.target:
        from fledge.data.tokenize import check_tokenized, load_tokenizer
        check_tokenized(args.dataset, load_tokenizer(args.target, template_needed=False), args.target)
    empty: list[int] = []
    counts = count_masked_tokens(args.dataset, target_vocab, empty)
    total = int(counts.sum())
    if total == 0:
        raise FledgeError(f"{args.dataset}: no sample has a trained token (every loss_mask is 0); "
                          f"nothing to build a vocab from")
    if empty:
        print(f"warning: {args.dataset}: {len(empty)} samples have no trained token (first at line "
              f"{empty[0]}); they add nothing", file=sys.stderr)
    ids = top_target_ids(counts, args.size)
    distinct, unseen = int((counts > 0).sum()), int((counts[ids] == 0).sum())
    stats = {"dataset": str(args.dataset), "target_vocab": target_vocab, "draft_vocab_size": args.size,
             "masked_tokens": total, "distinct_tokens": distinct, "samples_without_trained_token": len(empty),
             "unseen_in_vocab": unseen, "min_count_in_vocab": int(counts[ids].min()),
             "train_coverage": int(counts[ids].sum()) / max(total, 1)}
    if unseen:
        stats["warning"] = (f"{unseen} of the {args.size} vocab slots hold ids never seen in the data (it has "
                            f"{distinct} distinct trained tokens): they can never be drafted right; more data or "
                            f"--size {distinct} loses nothing")
        print(f"warning: {stats['warning']}", file=sys.stderr)
    if args.heldout:
        stats["heldout_coverage"] = coverage(ids, args.heldout)
    with keeping(args.out, "a previous vocab there is left as it was"):
        save_vocab(args.out, ids, target_vocab, stats)
    _print_rows(stats.items())
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.json')}")
    return 0


def run_coverage(args) -> int:
    ids, _ = load_vocab_ids(args.vocab)
    _print_rows([("vocab", args.vocab), ("dataset", args.dataset), ("coverage", coverage(ids, args.dataset))])
    return 0


def run_diff(args) -> int:
    (a, va), (b, vb) = load_vocab_ids(args.a), load_vocab_ids(args.b)
    if va != vb:
        print(f"note: target vocab sizes differ ({va} vs {vb}): the targets differ")
    _print_rows(diff_vocab(a, b).items())
    return 0
