"""Dataclass configs: the drafter's (derived from a target's config, saved as serving JSON), a
training run's and regen's. Torch-free, so the CLI's help shows the defaults written here, once.

A command builds its config one way: `from_args` (each field from the flag of its name, None
keeping the field's default), its help from `config_help`; checks live in `__post_init__`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fledge.core.conventions import (
    ROPE_THETA_DEFAULT,
    default_aux_layer_ids,
    rope_fields,
    validate_aux_layer_ids,
)
from fledge.core.errors import FledgeError
from fledge.core.files import check_no_overlap


def check_number(name: str, value, low: float = 0, high: float = math.inf, *, low_open: bool = False,
                 integer: bool = False, what: str = "") -> None:
    """The one range check of a config dataclass's numeric field (`__post_init__`): `value` must
    be a finite number (an int if `integer`; a bool, a string or NaN never is) in [low, high],
    (low, high] if `low_open`. `name` is the flag the user typed; `what` says whose it is."""
    ok_type = type(value) is int or (not integer and type(value) is float)
    above = ok_type and (value > low if low_open else value >= low)
    if not (ok_type and above and math.isfinite(value) and value <= high):
        span = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
        kind = "an integer" if integer else "a finite number"
        raise FledgeError(f"{what + ': ' if what else ''}{name} {value!r}: must be {kind} {span}")


@dataclass
class DraftConfig:
    """Llama decoder layers reading 3 target hidden states: the first over [embedding ; fused
    states], any further ones (`num_hidden_layers` > 1) plain layers on its output, as vLLM's
    `LlamaForCausalLMEagle3` builds them. Field names follow the config.json SGLang and vLLM read.

    `aux_layer_ids` are canonical (vLLM) ids: see `fledge.core.conventions`. `fc_norm` and
    `norm_output` are EAGLE-3.1's two changes to the layer (`fledge.drafter.eagle3` says what each does);
    both off is the EAGLE-3 layer. `ptd_token_id` set makes it a P-EAGLE drafter (parallel
    drafting: every draft after the first is a slot of this token with a learnt `mask_hidden`,
    all in one forward; vLLM's `parallel_drafting` reads the id under this name).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocab
    draft_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    aux_layer_ids: tuple[int, int, int]
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = ROPE_THETA_DEFAULT
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"
    fc_norm: bool = False
    norm_output: bool = False
    ptd_token_id: int | None = None
    num_hidden_layers: int = 1
    extra: dict[str, Any] = field(default_factory=dict)  # target fields carried verbatim

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "draft_vocab_size", "target_hidden_size", "target_num_layers",
                     "max_position_embeddings", "num_hidden_layers"):  # a config.json may hold "128" or 128.0: shapes need ints
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise FledgeError(f"draft config: {name} {v!r}: must be a positive integer")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if type(v) not in (int, float) or not (math.isfinite(v) and v > 0):
                raise FledgeError(f"draft config: {name} {v!r}: must be a finite number > 0")
        self.aux_layer_ids = validate_aux_layer_ids(self.aux_layer_ids, self.target_num_layers)
        if self.hidden_size != self.target_hidden_size:
            # EAGLE-3 reuses the target's embeddings, so the draft width must match.
            raise FledgeError(f"draft hidden_size {self.hidden_size} != target hidden size {self.target_hidden_size}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise FledgeError(f"draft_vocab_size {self.draft_vocab_size} must be in [1, {self.vocab_size}]")
        if self.num_attention_heads % self.num_key_value_heads:
            raise FledgeError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise FledgeError(f"hidden_act {self.hidden_act!r}: the EAGLE-3 midlayer is a SiLU Llama layer")
        if self.ptd_token_id is not None:
            check_number("ptd_token_id", self.ptd_token_id, 0, self.vocab_size - 1, integer=True, what="draft config")

    @property
    def parallel(self) -> bool:
        """Whether the drafter drafts in parallel (P-EAGLE): see the class doc."""
        return self.ptd_token_id is not None

    @classmethod
    def from_target(cls, tcfg, draft_vocab_size: int | None = None, aux_layer_ids=None,
                    intermediate_size: int | None = None) -> "DraftConfig":
        """Build the draft config from an HF target config (any family: only the text
        fields every causal LM has are read; attention geometry follows the target so the
        draft layer costs what one target layer costs)."""
        tcfg = getattr(tcfg, "text_config", None) or tcfg
        n = tcfg.num_hidden_layers
        h = tcfg.hidden_size
        heads = tcfg.num_attention_heads
        rope_theta, rope_scaling = rope_fields(tcfg.to_dict())
        return cls(
            hidden_size=h,
            intermediate_size=intermediate_size or getattr(tcfg, "intermediate_size", 4 * h),
            num_attention_heads=heads,
            num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(tcfg, "head_dim", None) or h // heads,
            vocab_size=tcfg.vocab_size,
            draft_vocab_size=draft_vocab_size or tcfg.vocab_size,
            target_hidden_size=h,
            target_num_layers=n,
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(n),
            max_position_embeddings=tcfg.max_position_embeddings,
            rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
        )

    def replace(self, **kw) -> "DraftConfig":
        return dataclasses.replace(self, **kw)


PARALLEL = ("ddp", "fsdp")  # how `fledge train` spreads over torchrun's ranks (FSDP2: fully_shard)
# How a fresh draft's lm_head starts: "fresh" random and trained; "target" the target's output
# rows of the draft vocab (and its final norm, Eagle3Draft.init_head_from), then trained;
# "frozen" those rows, never trained (speculators' EAGLE-3 recipe; the norm still trains).
HEADS = ("fresh", "target", "frozen")
# What `fledge train` minimises at each TTT step (fledge.train.loop.draft_loss says what each is).
LOSSES = ("kl", "greedy", "lk")
# The drafter kind `fledge train` trains: EAGLE-3 (its layers drafted step by step), P-EAGLE (the
# EAGLE-3 layers drafting a chain in one forward from mask slots: fledge.train.ttt,
# fledge.engine.parallel) or DFlash (a block drafted in one forward: fledge.drafter.dflash,
# fledge.train.dflash).
METHODS = ("eagle3", "peagle", "dflash")

# TrainConfig fields that `fledge train` sets with a plain `--name VALUE`: (option, type, what
# it sets). The help adds the field's default.
TRAIN_OPTIONS = (("max-steps", int, "optimizer steps (unset: --epochs passes over --data)"),
                 ("time-budget", float, "wall-clock seconds for this call: the step count is planned from a "
                                        "measured warm-up (instead of --max-steps); a run behind its plan pauses "
                                        "at the budget (checkpoint saved, exit 75)"),
                 ("epochs", int, "passes over --data when --max-steps is unset"),
                 ("batch-size", int, "sequences per rank per micro-batch"),
                 ("grad-accum", int, "micro-batches per optimizer step"),
                 ("lr", float, "peak learning rate (AdamW, cosine decay)"),
                 ("warmup", float, "share of the steps with linear warm-up"),
                 ("weight-decay", float, "AdamW weight decay"),
                 ("clip", float, "gradient norm clip"),
                 ("ttt-steps", int, "training-time-test unroll: draft steps trained per position"),
                 ("step-decay", float, "loss weight of TTT step j is step-decay**j"),
                 ("cod", float, "COD sampling (P-EAGLE's reference trainers): TTT step j trains a random "
                                "max(cod**j, cod-floor) share of the rows, nested across steps, its loss "
                                "scaled up to match (unset: every row at every step)"),
                 ("cod-floor", float, "the least share of rows any TTT step trains under --cod"),
                 ("max-len", int, "samples are cut to this many tokens"),
                 ("loop-cut", int, "cut each training sample once its answer repeats a stretch of this many "
                                   "tokens (one lap of a loop kept); 0 keeps whole samples; the held-out set is "
                                   "never cut"),
                 ("eval-samples", int, "held-out samples split off --data when --eval-data is unset"),
                 ("draft-intermediate-size", int, "the draft's MLP width (unset: the target's, or --init's); with "
                                                  "--init, the warm start is widened to it (Eagle3Draft.widen_mlp)"),
                 ("seed", int, "random seed (data order, eval split)"),
                 ("log-every", int, "steps between training log lines"),
                 ("eval-every", int, "steps between held-out evaluations"),
                 ("save-every", int, "steps between resumable checkpoints"),
                 ("pad-multiple", int, "pad batches to a multiple of this length"))
# The ones `fledge adapt` passes through to its fine-tune: the draft's shape is OLD's, and the
# loss and optimizer constants stay fledge train's.
ADAPT_TRAIN_OPTIONS = tuple(o for o in TRAIN_OPTIONS if o[0] not in ("weight-decay", "clip", "step-decay",
                                                                     "draft-intermediate-size", "time-budget",
                                                                     "cod", "cod-floor"))


def is_url(s: str | None) -> bool:
    """Whether a --features value names a capture server to stream from, not a directory."""
    return bool(s) and s.startswith(("http://", "https://"))


@dataclass
class TrainConfig:
    data: str
    out: str
    target: str = "smollm2-135m"
    method: str = "eagle3"            # one of METHODS
    draft_layers: int | None = None   # draft decoder layers (None: dflash 2; eagle3/peagle 1, or --init's)
    blocks_per_sample: int = 64       # dflash: anchors drawn per sample and step
    mask_token_id: int | None = None  # dflash, peagle: None = fledge.train.dflash.default_mask_token
    vocab: str | None = None          # d2t/t2d file (`fledge vocab`); None: draft vocab = target vocab
    init: str | None = None           # warm start from an exported drafter directory
    head: str = "fresh"               # a fresh draft's lm_head: one of HEADS
    loss: str = "kl"                  # the training objective: one of LOSSES
    fc_norm: bool = False             # EAGLE-3.1's per-aux norms before fc; an --init without them gains them
    norm_output: bool = False         # EAGLE-3.1's post-norm state fed to the next step (also onto an --init)
    features: str | None = None       # offline feature directory; None: run the target online
    eval_data: str | None = None      # held-out set; None: `eval_samples` split off the training set
    eval_samples: int = 64
    aux_layers: tuple[int, ...] | None = None
    draft_intermediate_size: int | None = None  # the draft's MLP width (default: the target's or --init's; engines read it from config.json)
    max_len: int = 2048
    loop_cut: int = 0                 # cut training samples after the first repeat of this many tokens; 0: whole
    ttt_steps: int = 7
    step_decay: float = 0.8
    cod: float | None = None          # COD sampling ratio (eagle3, peagle); None: every row at every step
    cod_floor: float = 0.2
    batch_size: int = 8               # sequences per rank per micro-batch
    grad_accum: int = 1
    epochs: int = 1
    max_steps: int | None = None      # optimizer steps; None: `epochs` passes
    time_budget: float | None = None  # seconds: the step count is planned to fit (fledge.train.loop.budget_steps)
    lr: float = 1e-4
    warmup: float = 0.03              # share of steps with linear warm-up
    weight_decay: float = 0.0
    clip: float = 0.5
    seed: int = 0
    parallel: str = "ddp"             # ddp | fsdp (FSDP2 fully_shard), when run under torchrun
    bf16: bool = True                 # bf16 autocast (CUDA only)
    pad_multiple: int = 64
    log_every: int = 10
    eval_every: int = 200
    save_every: int = 200
    device: str | None = None

    def __post_init__(self):
        if self.aux_layers is not None:
            self.aux_layers = tuple(self.aux_layers)
        ints = {"ttt_steps": 1, "batch_size": 1, "grad_accum": 1, "max_len": 3, "loop_cut": 0, "eval_samples": 0,
                "epochs": 1, "log_every": 1, "eval_every": 1, "save_every": 1, "pad_multiple": 1,
                "max_steps": 1, "draft_intermediate_size": 1}
        for name, low in ints.items():  # unset optional ones (None) take their default elsewhere
            if getattr(self, name) is not None:
                check_number(f"--{name.replace('_', '-')}", getattr(self, name), low, integer=True, what="train config")
        check_number("--seed", self.seed, -2**63, integer=True, what="train config")
        floats = {"lr": (0, math.inf, True), "warmup": (0, 1, False), "weight_decay": (0, math.inf, False),
                  "clip": (0, math.inf, True), "step_decay": (0, 1, True), "time_budget": (0, math.inf, True),
                  "cod": (0, 1, True), "cod_floor": (0, 1, True)}
        for name, (low, high, low_open) in floats.items():  # a budget of inf would never finish planning
            v = getattr(self, name)
            if v is not None:
                check_number(f"--{name.replace('_', '-')}", float(v) if type(v) is int else v, low, high,
                             low_open=low_open, what="train config")
        checks = [(not (self.loop_cut and self.features), "--loop-cut cuts samples the stored --features cover whole; "
                                                          "drop one"),
                  (self.warmup < 1, "warmup is a share of steps in [0, 1)"),
                  (self.method in METHODS, f"method {self.method!r}: one of {', '.join(METHODS)}"),
                  ((self.draft_layers is None or self.draft_layers >= 1) and self.blocks_per_sample >= 1,
                   "draft_layers and blocks_per_sample must be >= 1"),
                  (self.method != "dflash" or not (self.fc_norm or self.norm_output),
                   "--fc-norm and --norm-output are EAGLE-3.1's; a dflash drafter has neither"),
                  (self.method != "dflash" or self.cod is None, "--cod samples TTT rows; a dflash run draws blocks "
                                                               "(--blocks-per-sample)"),
                  (self.parallel in PARALLEL, f"parallel {self.parallel!r}: {' or '.join(PARALLEL)}"),
                  (self.head in HEADS, f"head {self.head!r}: one of {', '.join(HEADS)}"),
                  (self.loss in LOSSES, f"loss {self.loss!r}: one of {', '.join(LOSSES)}"),
                  (not (self.init and self.head == "target"), "--init brings its own head; drop --head target"),
                  (not (self.time_budget and self.max_steps), "--time-budget plans the step count; drop --max-steps")]
        for ok, msg in checks:
            if not ok:
                raise FledgeError(f"train config: {msg}")
        paths = ("data", "vocab", "init", "eval_data") if is_url(self.features) else ("data", "vocab", "init", "features", "eval_data")
        for name in paths:
            if getattr(self, name) and not Path(getattr(self, name)).exists():
                raise FledgeError(f"--{name.replace('_', '-')} {getattr(self, name)}: does not exist")
        for name, want_dir in (("data", False), ("eval_data", False), ("init", True), ("features", True)):
            path = getattr(self, name)
            if name not in paths:
                continue
            if path and Path(path).is_dir() != want_dir:
                what = "a directory (drafter or feature dir)" if want_dir else "a tokenized JSONL file"
                raise FledgeError(f"--{name.replace('_', '-')} {path}: expected {what}")
        inputs = {f"--{n.replace('_', '-')}": getattr(self, n) for n in paths}
        for written in ("draft", "checkpoint", "metrics.jsonl", "curves.png", "result.json"):
            check_no_overlap(Path(self.out) / written, inputs)


@dataclass
class RegenConfig:
    """How the target answers: `fledge regen` (and `fledge prompts`, which samples prompts)."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    n: int = 1                   # samples per conversation (needs temperature > 0 to differ)
    max_turns: int | None = None  # assistant turns to write per conversation (None = all)
    max_len: int = 2048          # prompt + answer must fit; longer turns end the conversation
    chunk: int = 256             # conversations in flight between writes
    seed: int = 0
    batch_size: int = 64         # local engine: rows decoded together

    def __post_init__(self):
        for name in ("max_new_tokens", "n", "max_turns", "max_len", "chunk", "batch_size"):
            if getattr(self, name) is not None:
                check_number(f"--{name.replace('_', '-')}", getattr(self, name), 1, integer=True)
        check_number("--temperature", float(self.temperature), 0)
        check_number("--top-p", float(self.top_p), 0, 1, low_open=True)
        check_number("--seed", self.seed, -2**63, integer=True)
        if self.n > 1 and self.temperature == 0:
            raise FledgeError("--n > 1 with temperature 0 would write the same answer n times")
        if self.max_new_tokens >= self.max_len:
            raise FledgeError(f"max_new_tokens {self.max_new_tokens} must be < max_len {self.max_len}")


def from_args(cls, args, **given):
    """`cls` built by keyword from a command's parsed flags: each field from the flag of the same
    name unless that flag is None (not given: the field's default holds), then `given`. The one
    place a Namespace becomes a config, so library code never sees the Namespace."""
    names = {f.name for f in dataclasses.fields(cls)}
    flags = {k: v for k, v in vars(args).items() if k in names and v is not None}
    return cls(**{**flags, **given})


def config_help(cls, name: str, what: str) -> str:
    """`what` a flag sets, with the default of `cls`'s field `name` (dashes or underscores) where
    it has one: the help text reads the default from the dataclass instead of repeating it."""
    field_ = {f.name: f for f in dataclasses.fields(cls)}[name.replace("-", "_")]
    default = field_.default if field_.default is not dataclasses.MISSING else None
    return what if default is None else f"{what} (default: {default})"
