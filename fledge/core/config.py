"""Dataclass configs: the drafter's (derived from a target's config, saved as serving JSON)
and a training run's. Torch-free, so the CLI's help can show TrainConfig's defaults."""

from __future__ import annotations

import dataclasses
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


@dataclass
class DraftConfig:
    """One Llama decoder layer reading 3 target hidden states. Field names follow the
    `LlamaForCausalLMEagle3` config.json that SGLang and vLLM read.

    `aux_layer_ids` are canonical (vLLM) ids: see `fledge.core.conventions`. `fc_norm` and
    `norm_output` are EAGLE-3.1's two changes to the layer (`fledge.drafter.eagle3` says what each does);
    both off is the EAGLE-3 layer.
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
    extra: dict[str, Any] = field(default_factory=dict)  # target fields carried verbatim

    def __post_init__(self):
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
# The drafter kind `fledge train` trains: EAGLE-3 (one layer, drafted step by step) or DFlash (a
# block drafted in one forward: fledge.drafter.dflash, fledge.train.dflash).
METHODS = ("eagle3", "dflash")

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
                                                                     "draft-intermediate-size", "time-budget"))


@dataclass
class TrainConfig:
    data: str
    out: str
    target: str = "smollm2-135m"
    method: str = "eagle3"            # one of METHODS
    draft_layers: int = 2             # dflash: draft decoder layers
    blocks_per_sample: int = 64       # dflash: anchors drawn per sample and step
    mask_token_id: int | None = None  # dflash: None = fledge.train.dflash.default_mask_token
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
        checks = [(self.ttt_steps >= 1, "ttt_steps must be >= 1"), (0 < self.step_decay <= 1, "step_decay must be in (0, 1]"),
                  (self.batch_size >= 1 and self.grad_accum >= 1, "batch_size and grad_accum must be >= 1"),
                  (self.max_len >= 3, "max_len must be >= 3"),
                  (self.loop_cut >= 0, "loop_cut must be >= 0 (0 keeps whole samples)"),
                  (not (self.loop_cut and self.features), "--loop-cut cuts samples the stored --features cover whole; "
                                                          "drop one"),
                  (self.lr > 0, "lr must be > 0"),
                  (0 <= self.warmup < 1, "warmup is a share of steps in [0, 1)"), (self.clip > 0, "clip must be > 0"),
                  (self.method in METHODS, f"method {self.method!r}: one of {', '.join(METHODS)}"),
                  (self.draft_layers >= 1 and self.blocks_per_sample >= 1, "draft_layers and blocks_per_sample must be >= 1"),
                  (self.method == "eagle3" or not (self.fc_norm or self.norm_output),
                   "--fc-norm and --norm-output are EAGLE-3.1's; a dflash drafter has neither"),
                  (self.parallel in PARALLEL, f"parallel {self.parallel!r}: {' or '.join(PARALLEL)}"),
                  (self.head in HEADS, f"head {self.head!r}: one of {', '.join(HEADS)}"),
                  (self.loss in LOSSES, f"loss {self.loss!r}: one of {', '.join(LOSSES)}"),
                  (not (self.init and self.head == "target"), "--init brings its own head; drop --head target"),
                  (self.max_steps is None or self.max_steps >= 1, "max_steps must be >= 1"),
                  (self.time_budget is None or self.time_budget > 0, "time_budget must be > 0 seconds"),
                  (not (self.time_budget and self.max_steps), "--time-budget plans the step count; drop --max-steps"),
                  (min(self.log_every, self.eval_every, self.save_every, self.epochs) >= 1, "intervals/epochs must be >= 1"),
                  (self.draft_intermediate_size is None or self.draft_intermediate_size >= 1, "draft_intermediate_size must be >= 1")]
        for ok, msg in checks:
            if not ok:
                raise FledgeError(f"train config: {msg}")
        for name in ("data", "vocab", "init", "features", "eval_data"):
            if getattr(self, name) and not Path(getattr(self, name)).exists():
                raise FledgeError(f"--{name.replace('_', '-')} {getattr(self, name)}: does not exist")
        for name, want_dir in (("data", False), ("eval_data", False), ("init", True), ("features", True)):
            path = getattr(self, name)
            if path and Path(path).is_dir() != want_dir:
                what = "a directory (drafter or feature dir)" if want_dir else "a tokenized JSONL file"
                raise FledgeError(f"--{name.replace('_', '-')} {path}: expected {what}")
        inputs = {f"--{n.replace('_', '-')}": getattr(self, n) for n in ("data", "vocab", "init", "features", "eval_data")}
        for written in ("draft", "checkpoint", "metrics.jsonl", "curves.png", "result.json"):
            check_no_overlap(Path(self.out) / written, inputs)
