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
    positive_float,
    positive_int,
)
from fledge.core.catalog import (
    BUILTINS,
    DATASETS,
    DFLASH_LAYOUTS,
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
    p.add_argument("--method", choices=METHODS, help=train_help("method", "the drafter kind: EAGLE-3; P-EAGLE (EAGLE-3 "
                                                                  "drafting a chain of --ttt-steps in one forward); or "
                                                                  "a DFlash block drafter (--ttt-steps masks a block)"))
    p.add_argument("--draft-layers", type=int, help="draft decoder layers (default: dflash 2; eagle3 and peagle 1, or "
                                                    "--init's, which grows to more: Eagle3Draft.add_layers)")
    p.add_argument("--blocks-per-sample", type=int, help=train_help("blocks_per_sample", "dflash: blocks (anchors) "
                                                                    "drawn per sample and step"))
    p.add_argument("--mask-token-id", type=int, help="dflash, peagle: the target token whose embedding marks a slot to fill "
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
    p.add_argument("--layout", choices=sorted({*LAYOUTS, *DFLASH_LAYOUTS}),
                   help="eagle3 (default) or speculators; a DFlash drafter: dflash (default, vLLM's DFlashDraftModel "
                        "layout) or speculators")
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
    src.add_argument("--drafter", help="EAGLE-3 checkpoint directory (a P-EAGLE one drafts its chain in one forward)")
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
    p.add_argument("--method", choices=METHODS, default="eagle3",
                   help="drafter kind the miniature trains: EAGLE-3, P-EAGLE or DFlash (the last two draft a "
                        "chain in one forward)")
    p.add_argument("--prompts", type=positive_int, default=8, help="MT-Bench questions the target answers for training; "
                   "a target larger than the built-in 135M one gets fewer (fledge.demo.demo_sizes)")
    p.add_argument("--eval-prompts", type=positive_int, default=2, help="held-out questions for the eval and the speed check")
    p.add_argument("--new-tokens", type=positive_int, default=48,
                   help="tokens the target writes per answer, and per prompt in the speed check; fewer for a "
                        "larger target, as --prompts")
    p.add_argument("--draft-vocab", type=positive_int, default=2048, help="draft vocabulary size of the miniature drafter")
    p.add_argument("--train-steps", type=positive_int, default=20,
                   help="optimizer steps of the miniature training run (batch 2, lr 1e-3)")
    p.add_argument("--cpu-head-rows", type=int, default=4096,
                   help="speed check: the EAGLE-3 drafter's head cut to its first N rows, as a CPU favours")
    p.add_argument("--cpu-steps", type=int, default=3, help="speed check: chain length (draft steps a round)")
    p.add_argument("--repeats", type=int, default=2, help="speed check: interleaved repeats of AR and the drafter")
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
