"""`fledge export`, `fledge import` and `fledge init-draft`: the commands that write a drafter checkpoint
(through `checkpoint.export_checkpoint`, which checks what it wrote). export writes a serving layout,
import reads a SpecForge or speculators checkpoint into fledge's own, init-draft writes a fresh drafter
for a target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from fledge.core.catalog import DFLASH_LAYOUTS, LAYOUTS
from fledge.core.config import DraftConfig
from fledge.core.devices import parse_dtype
from fledge.core.errors import FledgeError
from fledge.core.files import check_no_overlap
from fledge.drafter.layout import is_dflash
from fledge.drafter.weights import model_config, open_checkpoint

if TYPE_CHECKING:  # the modules that import torch load only once the source has been found readable
    from fledge.drafter.checkpoint import ReadCheckpoint
    from fledge.drafter.eagle3 import Eagle3Draft


def _require_readable(src) -> None:
    """Refuse a source whose config or weights cannot be read before torch loads (~10 s)."""
    problems = open_checkpoint(src).unreadable()
    if problems:
        raise FledgeError(problems[0])


def _target_layers_arg(args) -> int | None:
    if not args.target_config:
        return args.target_layers
    p = Path(args.target_config)
    p = p / "config.json" if p.is_dir() else p
    try:
        return int(model_config(p)["num_hidden_layers"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise FledgeError(f"{p}: cannot read num_hidden_layers ({e})") from None


def _target(args):
    if not args.target:
        return None
    from fledge.core.target import (
        load_target,  # pulls in model code; only needed when a target is named
    )

    return load_target(args.target)


def _load_src(args) -> tuple[Eagle3Draft, ReadCheckpoint]:
    """The drafter `src`, with the target's embeddings and layer count when --target names one."""
    from fledge.drafter.checkpoint import read_checkpoint

    target_dir = args.target if args.target and Path(args.target).exists() else None  # not a built-in name
    check_no_overlap(args.out, {"src": args.src, "--target-config": args.target_config, "--target": target_dir})
    target = _target(args)
    return read_checkpoint(args.src, _target_layers_arg(args), embed_from=target and target.model)


def _summary(out: Path, layout: str, draft: Eagle3Draft) -> None:
    print(f"{'file':<44} {'MiB':>9}")
    for f in sorted(f for f in out.iterdir() if f.is_file()):
        print(f"{f.name:<44} {f.stat().st_size / 2**20:>9.2f}")
    c = draft.cfg
    print(f"wrote {out} ({layout}): target {c.target_num_layers} layers, aux ids {list(c.aux_layer_ids)} "
          f"(canonical), draft vocab {c.draft_vocab_size}/{c.vocab_size}")


def run_export(args) -> int:
    _require_readable(args.src)
    if is_dflash(args.src):
        return _export_dflash(args)
    layout = args.layout or "eagle3"
    if layout not in LAYOUTS:
        raise FledgeError(f"--layout {layout}: an EAGLE-3 drafter is written as {' or '.join(LAYOUTS)}")
    from fledge.drafter.checkpoint import export_checkpoint

    draft, _ = _load_src(args)
    out = export_checkpoint(draft, args.out, layout=layout, dtype=parse_dtype(args.dtype),
                            shard_size_mb=args.shard_size_mb, with_embed=args.with_embed,
                            verifier=args.verifier, overwrite=args.overwrite)
    _summary(out, layout, draft)
    return 0


def _export_dflash(args) -> int:
    """A DFlash drafter in either of its layouts (one weights file; the engines share the
    target's embeddings, so there is none to keep)."""
    from fledge.drafter.dflash_checkpoint import export_dflash, load_dflash

    layout = args.layout or "dflash"
    if layout not in DFLASH_LAYOUTS:
        raise FledgeError(f"--layout {layout}: {args.src} is a DFlash drafter, written as {' or '.join(DFLASH_LAYOUTS)}")
    if args.with_embed or args.shard_size_mb:
        raise FledgeError(f"{args.src}: a DFlash drafter is written as one file without embeddings: drop "
                          "--with-embed and --shard-size-mb")
    check_no_overlap(args.out, {"src": args.src})
    draft = load_dflash(args.src)
    out = export_dflash(draft, args.out, dtype=parse_dtype(args.dtype), verifier=args.verifier,
                        overwrite=args.overwrite, layout=layout)
    c = draft.cfg
    print(f"wrote {out} ({layout}): DFlash, {c.num_hidden_layers} layers, a block of {c.block_size}, aux ids "
          f"{list(c.aux_layer_ids)} (canonical), draft vocab {c.draft_vocab_size}/{c.vocab_size}")
    return 0


def run_import(args) -> int:
    """Into fledge's own (eagle3) layout, keeping the source's dtype, and its embeddings if it has them."""
    _require_readable(args.src)
    from fledge.drafter.checkpoint import export_checkpoint

    draft, r = _load_src(args)
    out = export_checkpoint(draft, args.out, layout="eagle3", dtype=parse_dtype(r.cfg.torch_dtype),
                            with_embed="embed_tokens.weight" in r.tensors, overwrite=args.overwrite)
    print(f"read {args.src} ({r.layout} layout)")
    _summary(out, "eagle3", draft)
    return 0


def run_init_draft(args) -> int:
    from fledge.drafter.checkpoint import export_checkpoint, verifier_of
    from fledge.drafter.eagle3 import Eagle3Draft

    check_no_overlap(args.out, {"--target": args.target if Path(args.target).exists() else None})
    target = _target(args)
    cfg = DraftConfig.from_target(target.model.config, draft_vocab_size=args.draft_vocab)
    cfg.extra["verifier"] = verifier_of(target)
    draft = Eagle3Draft.from_target(cfg, target.model)
    out = export_checkpoint(draft, args.out, layout="eagle3", dtype=parse_dtype(args.dtype), overwrite=args.overwrite)
    _summary(out, "eagle3", draft)
    return 0
