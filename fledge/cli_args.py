"""The arguments of every `fledge` subcommand, built from torch-free modules only.

Each `add_*` adds its subcommand(s) to the subparsers and names the handler as
"module:function" (`handler`): the step module is imported only when its subcommand runs,
so `fledge --help` and `fledge SUB --help` load neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os

from fledge.cli_checks import (
    check_side_outputs,
    fraction,
    nonneg_float,
    nonneg_int,
    number,
    positive_float,
    positive_int,
)
from fledge.core.catalog import (
    BUILTINS,
    DATASETS,
    FLOAT_DTYPES,
    FORMATS,
    HELDOUT_SUFFIX,
    LAYOUTS,
    SHORT_DTYPES,
)
from fledge.core.config import (
    ADAPT_TRAIN_OPTIONS,
    HEADS,
    LOSSES,
    METHODS,
    PARALLEL,
    TRAIN_OPTIONS,
    RegenConfig,
    TrainConfig,
    config_help,
)


def run_step(name: str, args) -> int | None:
    """Import the step module of `name` ("module:function") and run the function on `args`,
    its side outputs checked against its inputs first."""
    check_side_outputs(name, args)
    module, func = name.split(":")
    return getattr(importlib.import_module(module), func)(args)


def handler(name: str) -> functools.partial:
    """An argparse `func` for `name` ("module:function"): its module is imported when it runs."""
    return functools.partial(run_step, name)


def int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def add_chat_template(p) -> None:
    p.add_argument("--chat-template", metavar="FILE|plain",
                   help="render chats with this Jinja template (chat_template.jinja or .json) instead of the "
                        "target's own; 'plain' for a base model: the texts one after another, answers ended by "
                        "end-of-text. Without it the target's own is used, and a target with none is refused "
                        "before anything loads")


def add_target(sub) -> None:
    p = sub.add_parser("target", help="resolve and load a target; print its shape and aux layers")
    p.add_argument("spec", help=f"built-in name ({', '.join(BUILTINS)}), GGUF file, or HF model directory")
    p.add_argument("--json", help="also write the table as JSON here")
    p.set_defaults(func=handler("fledge.core.target:run_target"))


def add_prep(sub) -> None:
    p = sub.add_parser("prep", help="ingest prompt/conversation sets; optionally tokenize with a chat template")
    p.add_argument("sources", nargs="+", help=f"files, or built-in names: {', '.join(DATASETS)}")
    p.add_argument("--format", choices=list(FORMATS), help="input format (default: guessed per file)")
    p.add_argument("-o", "--out", help="output directory (train.jsonl, heldout.jsonl, summary.json)")
    p.add_argument("--heldout", type=int, default=500,
                   help="conversations held out from training (default: %(default)s)")
    p.add_argument("--tokenizer", help="HF dir, .gguf file or target name: also write *.tok.jsonl")
    p.add_argument("--max-len", type=int, default=2048,
                   help="tokens per training sequence: whole leading turns that fit are kept, longer "
                        "conversations cut (default: %(default)s)")
    p.add_argument("--limit", type=int, metavar="N",
                   help="keep only the first N conversations after dedup, before the held-out split "
                        "(a quick run: tokenizing all of ShareGPT takes ~20 min on a CPU; default: all)")
    p.add_argument("--show", type=int, default=0, metavar="N", help="print N samples with trained tokens marked")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    add_chat_template(p)
    p.set_defaults(func=handler("fledge.data.prep:run_prep"))


def add_regen(sub) -> None:
    p = sub.add_parser("regen", help="the target rewrites every assistant turn (engine or OpenAI servers)")
    p.add_argument("conversations", help="conversations JSONL (from `fledge prep`)")
    p.add_argument("out", help="output JSONL (appended; rerun to resume); counts go beside it, its "
                                "extension replaced (a.jsonl: a.summary.json)")
    p.add_argument("--target", default="smollm2-135m",
                   help="target for the local engine: HF dir, GGUF or built-in name (default: %(default)s)")
    p.add_argument("--server", action="append", default=[],
                   help="OpenAI-compatible base URL, e.g. http://host:30000 (repeatable: requests share the "
                        "servers; default: none, the local engine answers)")
    p.add_argument("--model", help="model name to request from the servers (default: the --target value)")
    p.add_argument("--concurrency", type=positive_int, default=16,
                   help="servers: requests in flight at once (default: %(default)s)")
    p.add_argument("--timeout", type=positive_float, default=120.0,
                   help="servers: seconds a request may take, reply included (default: %(default)s)")
    p.add_argument("--retries", type=nonneg_int, default=3,
                   help="servers: extra attempts after a 5xx, 429, timeout or dropped connection, "
                        "each on the next server (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="local engine: torch device (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="local engine: weights dtype (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, help=regen_help("batch_size", "local engine: rows decoded together"))
    p.add_argument("--max-new-tokens", type=int, help=regen_help("max_new_tokens", "longest answer per turn, in tokens"))
    p.add_argument("--temperature", type=float, help=regen_help("temperature", "sampling temperature; 0 is greedy"))
    p.add_argument("--top-p", type=float, help=regen_help("top_p", "nucleus sampling mass"))
    p.add_argument("--n", type=int, help=regen_help("n", "answers per conversation, ids <id>#k; needs --temperature > 0"))
    p.add_argument("--max-turns", type=int,
                   help="assistant turns to write per conversation, each user turn answered in order "
                        "(MT-Bench's turn 2 after the answer to turn 1); 1 keeps the first turn only "
                        "(default: all of them)")
    p.add_argument("--max-len", type=int, help=regen_help("max_len", "prompt + answer must fit in this many tokens; "
                                                          "a turn that does not ends the conversation"))
    p.add_argument("--chunk", type=int, help=regen_help("chunk", "conversations answered between writes to the output"))
    p.add_argument("--limit", type=int, help="only the first N conversations (default: all)")
    p.add_argument("--seed", type=int, help=regen_help("seed", "sampling seed; each answer's seed follows from it, "
                                                       "the sample id and the turn"))
    p.add_argument("--compile", action="store_true",
                   help="local engine: torch.compile its layers (on a GPU, decode attends through the prefix kernel)")
    add_chat_template(p)
    p.set_defaults(func=handler("fledge.data.regen:run_regen"))


def add_prompts(sub) -> None:
    p = sub.add_parser("prompts", help="the target writes user prompts itself (Magpie), for regen to answer")
    p.add_argument("out", help="output JSONL of one-turn conversations (appended; rerun to resume); "
                               "counts go beside it, its extension replaced (a.jsonl: a.summary.json)")
    p.add_argument("-n", type=positive_int, required=True, help="distinct prompts to write")
    p.add_argument("--target", default="smollm2-135m",
                   help="HF dir, GGUF or built-in name (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights dtype (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="rows decoded together (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256,
                   help="longest prompt; one cut off here is dropped (default: %(default)s)")
    p.add_argument("--temperature", type=nonneg_float, default=1.0, help="sampling temperature (default: %(default)s)")
    p.add_argument("--top-p", type=fraction, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--chunk", type=positive_int, default=1024,
                   help="prompts sampled between writes to the output (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed; each round's follows from it (default: %(default)s)")
    p.add_argument("--compile", action="store_true", help="torch.compile the engine's layers (on a GPU)")
    p.set_defaults(func=handler("fledge.data.prompts:run_prompts"))


def add_tokenize(sub) -> None:
    p = sub.add_parser("tokenize", help="conversations (from regen) → train/held-out samples with loss masks")
    p.add_argument("conversations", nargs="+", help="conversations JSONL or .jsonl.gz (sources ending in "
                   f"{HELDOUT_SUFFIX!r} go to the held-out set)")
    p.add_argument("-o", "--out", required=True, help="output dir: train.tok.jsonl, heldout.tok.jsonl, summary.json")
    p.add_argument("--tokenizer", required=True,
                   help="the target's tokenizer: HF dir, .gguf file or target name (recorded in every sample)")
    p.add_argument("--heldout", action="append", default=[], metavar="FILE",
                   help="conversations that all go to the held-out set (repeatable)")
    p.add_argument("--max-len", type=positive_int, default=2048)
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1, help="processes (default: one per CPU)")
    p.add_argument("--overwrite", action="store_true")
    add_chat_template(p)
    p.set_defaults(func=handler("fledge.data.tokenize:run_tokenize"))


def add_vocab(sub) -> None:
    p = sub.add_parser("vocab", help="draft vocabulary (d2t/t2d): build, coverage, diff")
    vs = p.add_subparsers(dest="vocab_command", required=True)
    b = vs.add_parser("build", help="top-N loss-masked target tokens of a tokenized training set")
    b.add_argument("dataset", help="tokenized training set JSONL (input_ids, loss_mask)")
    b.add_argument("--size", type=positive_int, required=True, help="draft vocab size N")
    b.add_argument("--target-vocab", type=positive_int, help="target vocab size (default: read from --target's config)")
    b.add_argument("--target", help="target spec (HF dir, GGUF, built-in name): vocab_size from its config")
    b.add_argument("--heldout", help="tokenized held-out JSONL to report coverage on (default: none)")
    b.add_argument("-o", "--out", required=True, help="output .safetensors ({d2t, t2d}); stats go to .json")
    b.set_defaults(func=handler("fledge.data.vocab:run_build"))
    c = vs.add_parser("coverage", help="share of a tokenized set's trained tokens inside a draft vocab")
    c.add_argument("vocab", help="vocab .safetensors or drafter checkpoint dir")
    c.add_argument("dataset", help="tokenized JSONL (input_ids, loss_mask) whose trained tokens are counted")
    c.set_defaults(func=handler("fledge.data.vocab:run_coverage"))
    d = vs.add_parser("diff", help="compare two draft vocabs (vocab files or drafter checkpoint dirs)")
    d.add_argument("a", help="first vocab: a .safetensors with d2t (and t2d), or a drafter checkpoint dir")
    d.add_argument("b", help="second vocab, the same kinds; entries are compared position by position")
    d.set_defaults(func=handler("fledge.data.vocab:run_diff"))


def add_features(sub) -> None:
    p = sub.add_parser("features", help="write target features (aux + final hidden) for offline training: computed "
                                        "here, or captured from a vLLM/SGLang server (--server)")
    p.add_argument("--target", required=True, help="target model (path or built-in name)")
    p.add_argument("--data", help="tokenized training set JSONL (required unless --print-launch)")
    p.add_argument("--out", help="feature directory (resumed if it exists; required unless --print-launch)")
    p.add_argument("--dtype", choices=sorted(SHORT_DTYPES), default="bf16", help="storage dtype (fp32 for exact parity)")
    p.add_argument("--max-len", type=positive_int, default=2048)
    p.add_argument("--aux-layers", type=int_list, default=None,
                   help="canonical aux layer ids, e.g. 2,15,27 (default: conventions)")
    p.add_argument("--shard-size", type=positive_int, default=256, help="samples per shard")
    p.add_argument("--batch-size", type=positive_int, default=8, help="samples per forward of the target in this process")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    s = p.add_argument_group("capture from a serving engine")
    s.add_argument("--server", help="base URL of a capture server started with the line --print-launch prints")
    s.add_argument("--engine", choices=("vllm", "sglang"), default="vllm", help="the server's engine (default vllm)")
    s.add_argument("--served-name", help="the model name the server serves (default: --target)")
    s.add_argument("--print-launch", action="store_true",
                   help="print the vLLM launch line of a capture server for --target and --aux-layers, then exit")
    s.add_argument("--storage", help="with --print-launch: where the server writes states before fledge reads "
                                     "and deletes them (default /tmp/fledge-hidden-states; must be visible to both)")
    s.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    s.add_argument("--retries", type=int, default=3, help="retries of a failed request (default 3)")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    p.set_defaults(func=handler("fledge.train.capture_run:run_features"))


def train_help(name: str, what: str) -> str:
    return config_help(TrainConfig, name, what)


def regen_help(name: str, what: str) -> str:
    return config_help(RegenConfig, name, what)


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train an EAGLE-3 drafter (TTT); run under torchrun for several GPUs")
    p.add_argument("--data", required=True, help="tokenized training set JSONL")
    p.add_argument("--out", required=True, help="run directory (resumed if it holds a checkpoint)")
    p.add_argument("--target", help=train_help("target", "target model (path or built-in name)"))
    p.add_argument("--vocab", help="d2t/t2d file from `fledge vocab`; with --init, the warm start's head moves to "
                                   "this vocabulary (Eagle3Draft.change_vocab)")
    p.add_argument("--init", help="warm start from an exported drafter directory")
    p.add_argument("--features", help="feature directory from `fledge features`, or the URL of a capture server "
                                      "to stream them from (nothing written); default: computed online")
    p.add_argument("--eval-data", help="held-out tokenized set (default: --eval-samples split off --data)")
    p.add_argument("--aux-layers", type=lambda s: tuple(int_list(s)), help="canonical ids, e.g. 2,15,27")
    for name, typ, what in TRAIN_OPTIONS:
        p.add_argument(f"--{name}", type=typ, help=train_help(name, what))
    p.add_argument("--parallel", choices=PARALLEL, help=train_help("parallel", "under torchrun"))
    p.add_argument("--no-bf16", dest="bf16", action="store_false", default=None, help="fp32 on CUDA")
    p.add_argument("--head", choices=HEADS, help=train_help("head", "a fresh draft's lm_head: random (fresh), the "
                                                              "target's rows (target), or those rows frozen (frozen)"))
    p.add_argument("--loss", choices=LOSSES, help=train_help("loss", "the objective per TTT step: soft cross-entropy "
                                                             "to the target (kl), plus the hard CE of its argmax "
                                                             "(greedy), or an acceptance-rate hybrid (lk)"))
    p.add_argument("--fc-norm", action="store_true", default=None,
                   help="EAGLE-3.1: each aux state through its own RMSNorm before fc; an --init without them "
                        "gains them, their weights at its aux states' median RMS")
    p.add_argument("--norm-output", action="store_true", default=None,
                   help="EAGLE-3.1: the next draft step reads the final-norm state (also onto an --init)")
    p.add_argument("--method", choices=METHODS, help=train_help("method", "the drafter kind: EAGLE-3, or a DFlash "
                                                                  "block drafter (--ttt-steps masks a block)"))
    p.add_argument("--draft-layers", type=int, help=train_help("draft_layers", "dflash: draft decoder layers"))
    p.add_argument("--blocks-per-sample", type=int, help=train_help("blocks_per_sample", "dflash: blocks (anchors) "
                                                                    "drawn per sample and step"))
    p.add_argument("--mask-token-id", type=int, help="dflash: the target token whose embedding marks a slot to fill "
                                                     "(default: the tokenizer's highest-id added token that is not "
                                                     "one of its own special tokens)")
    p.add_argument("--device")
    p.set_defaults(func=handler("fledge.train.loop:run_train"))


def add_target_layers(p) -> None:
    p.add_argument("--target-layers", type=positive_int, help="target decoder layer count (if config.json lacks it)")
    p.add_argument("--target-config", help="target config.json (or its dir) to read the layer count from")
    p.add_argument("--target", help="target (HF dir, GGUF, built-in name): its layer count, and its embeddings "
                                    "for a drafter saved without them (--with-embed)")


def add_checkpoint(sub) -> None:
    dtypes = ", ".join([*FLOAT_DTYPES, *SHORT_DTYPES])
    p = sub.add_parser("export", help="write a drafter as an SGLang/vLLM (eagle3) or speculators checkpoint")
    p.add_argument("src", help="drafter checkpoint dir (any layout fledge reads)")
    p.add_argument("out", help="output dir (written atomically)")
    p.add_argument("--layout", choices=LAYOUTS, default="eagle3")
    p.add_argument("--shard-size-mb", type=positive_float, help="split weights into shards of at most this size")
    p.add_argument("--dtype", default="bfloat16", help=f"float dtype: {dtypes} (default bfloat16)")
    p.add_argument("--with-embed", action="store_true", help="keep embed_tokens (default: engines share the target's)")
    p.add_argument("--verifier", help="target model name/path recorded for `vllm serve <dir>` (speculators)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output dir (never one holding an input)")
    add_target_layers(p)
    p.set_defaults(func=handler("fledge.drafter.export:run_export"))

    p = sub.add_parser("import", help="read an eagle3 / speculators / SpecForge drafter into fledge's layout")
    p.add_argument("src", help="drafter dir: eagle3 (SGLang/vLLM/SpecForge/EAGLE, safetensors or pytorch_model.bin) "
                               "or speculators layout")
    p.add_argument("out", help="output dir, fledge's eagle3 layout in the source's dtype, embeddings kept if present "
                               "(written atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output dir (default: refuse)")
    add_target_layers(p)
    p.set_defaults(func=handler("fledge.drafter.export:run_import"))

    p = sub.add_parser("init-draft", help="a fresh drafter for a target (target embeddings, eagle3 layout)")
    p.add_argument("out")
    p.add_argument("--target", required=True, help="target HF dir, GGUF or built-in name")
    p.add_argument("--draft-vocab", type=positive_int, help="draft vocab size (default: the target's full vocab)")
    p.add_argument("--dtype", default="bfloat16", help=f"float dtype: {dtypes}")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=handler("fledge.drafter.export:run_init_draft"))


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate with the engine: AR, or speculative with a drafter / oracle / n-gram")
    p.add_argument("--target", required=True, help="built-in name, GGUF file or HF directory")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--drafter", help="EAGLE-3 checkpoint directory")
    src.add_argument("--oracle", action="store_true", help="draft the target's own greedy continuation (the ceiling)")
    src.add_argument("--ngram", type=positive_int, metavar="N", help="prompt-lookup drafting with n-grams up to N")
    p.add_argument("--num-steps", type=positive_int, default=7, help="draft forwards per round (SGLang --speculative-num-steps)")
    p.add_argument("--topk", type=positive_int, default=1, help="children per expanded node (SGLang --speculative-eagle-topk)")
    p.add_argument("--num-draft-tokens", type=positive_int, default=None,
                   help="tree nodes verified per round, root included (default num-steps+1 for a chain)")
    p.add_argument("--temperature", type=nonneg_float, default=0.0)
    p.add_argument("--top-p", type=fraction, default=1.0)
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--seed", type=int, default=0)
    msg = p.add_mutually_exclusive_group(required=True)
    msg.add_argument("--prompt", help="one user message")
    msg.add_argument("--messages", help="a JSON list of chat messages, inline or a file")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--dtype", help=f"{', '.join(FLOAT_DTYPES)} (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--json", help="also write the output ids and stats here")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target's layer functions and the drafter's halves (CUDA; slow start)")
    p.add_argument("--phased", action="store_true",
                   help="run each round's steps apart and time them (draft / verify / other ms) instead of one fused graph")
    add_chat_template(p)
    p.set_defaults(func=handler("fledge.engine.generate:run_generate"))


def add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="check an exported drafter (and a launch line) before deploying",
                       description="PASS/WARN/FAIL checks; exit 0 all pass, 1 warnings, 2 failures.")
    p.add_argument("drafter", help="exported drafter directory (config.json + safetensors)")
    p.add_argument("--target", help="target model (HF directory or a name fledge.core.target knows)")
    p.add_argument("--launch", help='the SGLang or vLLM server command, quoted: "python -m sglang.launch_server ..."')
    p.add_argument("--against", metavar="OTHER_DRAFTER", help="compare the draft vocabulary with another drafter")
    p.add_argument("--features", metavar="DIR", help="the features the drafter trains on (`fledge features`, from the "
                   "target in process or a vLLM/SGLang server): aux layers, width, final norm and target must agree")
    p.add_argument("--json", action="store_true", help="print machine-readable results")
    p.add_argument("--probe", type=positive_int, metavar="N", help="live probe: acceptance on N held-out prompts (needs --target)")
    p.add_argument("--probe-prompts", default="mtbench", help="prompt source for the probe (file or built-in name)")
    p.add_argument("--probe-tokens", type=positive_int, default=64, help="new tokens per probe prompt")
    p.add_argument("--probe-steps", type=positive_int, default=5, help="chain length the probe drafts")
    p.add_argument("--device", help="probe device (default: cuda if available)")
    p.set_defaults(func=handler("fledge.doctor.doctor:run_doctor"))


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the whole loop in miniature on the built-in target (CPU, minutes)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="target model: built-in name, GGUF file or HF directory")
    p.add_argument("--workdir", default="runs/demo", help="where every step writes its files and demo.json")
    p.add_argument("--prompts", type=positive_int, default=8, help="MT-Bench questions the target answers for training")
    p.add_argument("--eval-prompts", type=positive_int, default=2, help="held-out questions for the eval and the speed check")
    p.add_argument("--new-tokens", type=positive_int, default=48,
                   help="tokens the target writes per answer, and per prompt in the speed check")
    p.add_argument("--draft-vocab", type=positive_int, default=2048, help="draft vocabulary size of the miniature drafter")
    p.add_argument("--train-steps", type=positive_int, default=20,
                   help="optimizer steps of the miniature training run (batch 2, lr 1e-3)")
    p.add_argument("--cpu-head-rows", type=int, default=4096,
                   help="speed check: the drafter's head cut to its first N rows, as a CPU favours")
    p.add_argument("--cpu-steps", type=int, default=3, help="speed check: chain length (draft steps a round)")
    p.add_argument("--repeats", type=int, default=2, help="speed check: interleaved repeats of AR and EAGLE-3")
    add_chat_template(p)
    p.set_defaults(func=handler("fledge.demo:run_demo"))


def add_adapt(sub) -> None:
    p = sub.add_parser("adapt", help="retarget a trained drafter to a new target version, then fine-tune it")
    p.add_argument("--drafter", required=True, help="OLD's exported drafter directory")
    p.add_argument("--target", required=True, help="NEW target (HF dir, GGUF, built-in name)")
    p.add_argument("--data", required=True, help="tokenized training set made with NEW (input_ids, loss_mask)")
    p.add_argument("--out", required=True, help="run directory: init/, train/, adapt.json (resumed if rerun)")
    p.add_argument("--rebuild-vocab", action="store_true",
                   help="build the draft vocab from --data's most frequent tokens (default: keep OLD's; rebuild "
                        "only when --data is large or NEW's tokenizer differs)")
    p.add_argument("--draft-vocab", type=positive_int, help="size of the rebuilt vocab (with --rebuild-vocab; default: OLD's)")
    p.add_argument("--no-train", dest="train", action="store_false", help="write <out>/init only, no fine-tune")
    for name, typ, what in ADAPT_TRAIN_OPTIONS:  # the fine-tune's defaults are fledge train's
        p.add_argument(f"--{name}", type=typ, help=train_help(name, what))
    p.add_argument("--eval-data", help="held-out tokenized set (default: --eval-samples split off --data)")
    p.add_argument("--features", help="offline features of NEW on --data from `fledge features` (default: "
                                      "run NEW online)")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", default=None,
                   help="fine-tune in fp32 on CUDA (default: bf16 autocast on CUDA; the CPU always runs fp32)")
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available)")
    p.set_defaults(func=handler("fledge.train.adapt:run_adapt"))

def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="measure spec decoding: a server (--url), a serving log (--log), or the engine")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--url", help="OpenAI-compatible server, e.g. http://127.0.0.1:30000/v1")
    src.add_argument("--log", help="SGLang or vLLM server log to summarise")
    src.add_argument("--target", help="engine: target (built-in name, GGUF, HF dir)")
    p.add_argument("--drafter", help="engine: EAGLE-3 checkpoint directory")
    p.add_argument("--shapes", default="3,1,4;7,1,8;5,4,16", help="engine: STEPS,TOPK,TOKENS;... to run")
    p.add_argument("--probe", action="store_true", help="engine: also measure acceptance by depth and rank (for tune)")
    p.add_argument("--probe-steps", type=positive_int, default=6)
    p.add_argument("--probe-topk", type=positive_int, default=4)
    p.add_argument("--prompts", help="engine: conversations file or built-in set (default mtbench)")
    p.add_argument("--num-prompts", type=positive_int, default=10)
    p.add_argument("--prompt-file", help="server: conversations (a file `fledge prep` writes, any format it reads, or "
                                         "a built-in set); the first user turn of --num-prompts of them")
    p.add_argument("--model", help="server: model name (default: the first the server lists)")
    p.add_argument("--baseline-url", help="server: a plain (non-speculating) server of the same target, measured "
                                          "interleaved with --url; the table gives the ratio")
    p.add_argument("--rounds", type=int, default=4, help="server, with --baseline-url: turns each level's requests "
                                                         "are cut into, the servers alternating")
    p.add_argument("--baseline-log", help="log, with --log: a plain server's log; the ratio of generation throughput")
    p.add_argument("--concurrency", default="1,4,16", help="server: comma-separated levels")
    p.add_argument("--requests", type=positive_int, default=16, help="server: requests per level")
    p.add_argument("--duration", type=positive_float, default=120.0, help="server: seconds per level, at most")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="server: seconds per request")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--png", help="plot here: engine, acceptance by depth and tok/s by shape; server, tok/s by "
                                 "concurrency per server")
    add_chat_template(p)
    p.set_defaults(func=handler("fledge.perf.bench:run_bench"))


def add_serve_sweep(sub) -> None:
    p = sub.add_parser("serve-sweep", help="serve the target plain and with the drafter at each k; measure interleaved",
                       description="Starts vLLM plain (kept up) and with the drafter drafting chains of each k, one "
                       "server at a time; measures each against the plain one interleaved; reads the accept length "
                       "from the server's /metrics; prints a table with tune's calibrated prediction beside each row. "
                       "--dry-run prints the launch lines (SGLang, remote clusters: run them yourself).")
    p.add_argument("--target", required=True, help="the served model: HF directory, hub id, or a built-in name")
    p.add_argument("--drafter", required=True, help="EAGLE-3 drafter directory")
    p.add_argument("--ks", default="1,2,3,4,5", help="chain depths (num_speculative_tokens) to serve")
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="sglang: --dry-run only")
    p.add_argument("--python", help="the engine's python (default: fledge's vLLM CPU venv, scripts/setup_vllm.sh)")
    p.add_argument("--extra", help="more engine arguments, quoted: \"--tensor-parallel-size 8\"")
    p.add_argument("--served-name", help="served model name (default: the target directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="--dry-run lines: the host to bind")
    p.add_argument("--port", type=int, default=8000, help="--dry-run lines: the first port (each line the next)")
    p.add_argument("--max-model-len", type=int, default=1024, help="CPU venv: vLLM's --max-model-len")
    p.add_argument("--dtype", default="float32", help="CPU venv: served dtype (also the prediction's)")
    p.add_argument("--plain-url", help="a plain server already up (its /v1 URL) instead of starting one")
    p.add_argument("--prompt-file", help="conversations (`fledge prep` output, any format it reads, or a built-in set; "
                                         "default mtbench): the first user turn of --num-prompts of them")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--requests", type=int, help="requests per server and level (default: one per prompt)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1", help="comma-separated levels")
    p.add_argument("--rounds", type=int, default=4, help="turns each level's requests are cut into, servers alternating")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to answer /health")
    p.add_argument("--gpu", default="cpu", help="hardware table entry tune calibrates from (empty: no prediction)")
    p.add_argument("--cuda-graphs", action="store_true", help="the prediction assumes CUDA graphs (off on the CPU)")
    p.add_argument("--context", type=int, default=256, help="the prediction's context length (prompt + half the answer)")
    p.add_argument("--log-dir", help="vLLM's logs (default: a new temporary directory)")
    p.add_argument("--dry-run", action="store_true", help="print the launch lines and exit")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--png", help="plot tok/s and accept length by k here")
    p.set_defaults(func=handler("fledge.perf.sweep:run_sweep"))


class Moved(argparse.Action):
    """An old spelling of a tune option or mode: one line naming the new one, exit 2."""

    def __init__(self, option_strings, dest, new: str, nargs=0, **kw):
        super().__init__(option_strings, dest, nargs=nargs, help=f"old spelling: now {new}", **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"fledge: error: tune {option_string} is now {self.new}\n")


def _moved(p, flags: dict) -> None:
    for flag, (new, nargs) in flags.items():
        p.add_argument(flag, action=Moved, new=new, nargs=nargs)


def _tune_acceptance(p) -> None:
    p.add_argument("--accept-length", type=number(float, 1), help="measured accept length (SGLang's, bonus incl.); see --accept-shape")
    p.add_argument("--accept-shape", help="STEPS,TOPK,TOKENS the --accept-length was measured at (default: a chain of "
                                          "--accept-steps)")
    p.add_argument("--accept-steps", type=positive_int, default=3, help="chain length --accept-length was measured at")
    p.add_argument("--accept-profile", help="per-depth acceptance, ranks by '/': '0.7/0.1,0.6/0.12,0.5'")
    p.add_argument("--accept-json", help="acceptance profile from `fledge bench --json` (engine --probe, a vLLM --log) "
                                         "or `tune calibrate --out`")


def _tune_common(p) -> None:
    p.add_argument("--max-depth", type=number(int, 1, 64), default=8, help="deepest speculation (draft steps) to consider (engine "
                                                            "mode: also the probe's depth)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size the timings are for")
    p.add_argument("--margin", type=nonneg_float, default=0.05, help="a shape pays only above this fractional gain")
    p.add_argument("--json", help="write the predictions here")
    p.add_argument("--png", help="plot speed-up by shape (and by concurrency) here")
    _moved(p, {"--max-steps": ("--max-depth", 1), "--profile-json": ("--accept-json", 1),
               "--profile": ("--hardware-profile", 1)})


def _tune_models(p, need_model: bool) -> None:
    p.add_argument("--model", required=need_model, help="target config: a config.json, a model directory, or a built-in")
    p.add_argument("--drafter", help="drafter directory or config.json (default: one target-shaped EAGLE-3 layer); "
                                     "printed in the vLLM flags")
    p.add_argument("--dtype", help="activations and unquantised weights: bf16 (default), fp16, fp32")
    p.add_argument("--quant", choices=["bf16", "fp16", "fp8", "int4", "fp32"], help="MLP/expert weights (default: from "
                                                                                     "the config)")
    p.add_argument("--draft-vocab", type=positive_int, help="drafter LM head rows (default: its config, else 32000)")


def _tune_machine(p) -> None:
    from fledge.perf.hwmodel import GPUS  # torch-free, as this module must stay
    from fledge.perf.servemodel import FAMILIES

    p.add_argument("--gpu", help=f"closest device in the table: {', '.join(GPUS)}")
    p.add_argument("--tp", type=positive_int, help="tensor-parallel GPUs (default 1)")
    p.add_argument("--interconnect", choices=["pcie", "nvlink"], help="link between the TP GPUs (default nvlink)")
    p.add_argument("--engine", choices=FAMILIES, help="the engine you serve with: its fitted constants, and the "
                                                          "verdict leads with what it can run (vLLM: chains)")
    p.add_argument("--context", type=positive_int, help="tokens in each sequence's KV cache (default 2048; 256 on --gpu cpu)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="the server runs without CUDA graphs (default on "
                                                                 "--gpu cpu)")


def add_tune(sub) -> None:
    p = sub.add_parser("tune", help="will speculation pay, with which flags: predict tok/s per shape",
                       description="Modes: `model` (configs + hardware + engine: fitted on published measurements, "
                       "every prediction with its range), `calibrate` (your plain server measured: predict the "
                       "speculating one), `engine` (measure fledge's engine), `what-if` (your own timings).")
    _moved(p, {"--what-if": ("`fledge tune what-if`", 0), "--model": ("`fledge tune model --model ...`", 1),
               "--target": ("`fledge tune engine --target ...`", 1)})
    modes = p.add_subparsers(dest="mode", required=True, metavar="{model,calibrate,engine,what-if}")

    m = modes.add_parser("model", help="predict from the configs, the hardware and the engine (no GPU)")
    _tune_models(m, True)
    _tune_machine(m)
    _tune_acceptance(m)
    _tune_common(m)
    m.add_argument("--output-len", type=positive_int, help="new tokens a request generates: rates of whole requests, their "
                                                  "prefill included, as serving benchmarks count them")
    m.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256", help="levels of the speed-up-by-concurrency sweep")
    m.add_argument("--hardware-profile", help="a `tune calibrate --out` profile: the model calibrated on your server")
    for flag, typ, h in [("--hbm-gbs", positive_float, "memory bandwidth, GB/s"),
                         ("--tflops", positive_float, "peak dense TFLOP/s of the math dtype"),
                         ("--allreduce-us", nonneg_float, "all-reduce latency, us"),
                         ("--allreduce-gbs", positive_float, "all-reduce bus bandwidth, GB/s"),
                         ("--host-ms", nonneg_float, "host time per serving step, ms"),
                         ("--bw-efficiency", fraction, "fraction of peak bandwidth reached"),
                         ("--flops-efficiency", fraction, "fraction of peak FLOP/s reached")]:
        m.add_argument(flag, type=typ, help=f"override: {h}")
    m.set_defaults(func=handler("fledge.perf.tune:run_model"))

    c = modes.add_parser("calibrate", help="measure your plain server (and any speculating one); predict speculation")
    c.add_argument("--url", action="append", required=True, help="OpenAI-compatible server (repeat for several)")
    c.add_argument("--metrics-url", action="append", help="its Prometheus /metrics (default: URL's host + /metrics)")
    _tune_models(c, False)
    _tune_machine(c)
    c.add_argument("--levels", help="concurrency levels to measure (default 1,2,4,...,256; 1,2,4 on --gpu cpu)")
    c.add_argument("--requests", type=positive_int, default=4, help="requests per level (at least the level's concurrency)")
    c.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens each request generates")
    c.add_argument("--predict-ks", default="1,2,3,4,5", help="chains to predict from the measured plain server")
    _tune_acceptance(c)
    c.add_argument("--out", help="profile JSON to write (default fledge-profile.json)")
    c.add_argument("--merge", help="an earlier profile whose points join this fit (servers measured one at a time)")
    c.set_defaults(func=handler("fledge.perf.calibrate:cmd_calibrate"))

    e = modes.add_parser("engine", help="measure fledge's own engine, predict every shape, optionally run them")
    e.add_argument("--target", required=True, help="target (built-in name, GGUF, HF dir)")
    e.add_argument("--drafter", required=True, help="drafter checkpoint")
    e.add_argument("--device", help="default cuda if available, else cpu")
    e.add_argument("--dtype", help="default bfloat16 on cuda, float32 on cpu")
    e.add_argument("--prompts", help="conversations JSONL for the acceptance probe (default: built-in prompts)")
    e.add_argument("--num-prompts", type=positive_int, default=8)
    e.add_argument("--max-new-tokens", type=positive_int, default=128)
    e.add_argument("--probe-topk", type=positive_int, default=4, help="topk of the full tree the rank probe drafts")
    e.add_argument("--accept-json", help="an acceptance profile instead of the probe")
    e.add_argument("--validate", action="store_true", help="also run >= 8 shapes for real: predicted vs measured")
    e.add_argument("--shapes", help="with --validate: STEPS,TOPK,TOKENS;... to run (default: 8 picked from the ranking)")
    _tune_common(e)
    e.set_defaults(func=handler("fledge.perf.tune_engine:run_engine"))

    w = modes.add_parser("what-if", help="your own timings and acceptance (no GPU)")
    w.add_argument("--ar-ms", type=positive_float, required=True, help="plain decoding: ms per step")
    w.add_argument("--verify-ms", required=True, help="target forward ms by tokens verified per request, e.g. "
                                                      "'1:11.6,8:30,16:34'")
    w.add_argument("--draft-ms", help="ms per draft step, one number or by topk '1:1.2,4:1.6' (absent: predicted from "
                                      "--model and --gpu)")
    w.add_argument("--overhead-ms", type=nonneg_float, default=0.0, help="per-round extra (sampling, KV moves, host)")
    _tune_models(w, False)
    _tune_machine(w)
    _tune_acceptance(w)
    _tune_common(w)
    w.set_defaults(func=handler("fledge.perf.tune:run_what_if"))


# Subcommands in pipeline order, each a function adding its parser(s).
COMMANDS = [add_target, add_prep, add_prompts, add_regen, add_tokenize, add_vocab, add_features, add_train, add_checkpoint,
            add_doctor, add_demo, add_generate, add_bench, add_serve_sweep, add_tune, add_adapt]
