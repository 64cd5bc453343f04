"""Validate the corpus of published speculative-decoding measurements in this folder.

Every `<source-id>.json` here holds a list of row records, one per measured configuration, in
the schema README.md describes. This script checks that every file parses, every record has
exactly the agreed keys with sane types and values, the speed-up agrees with the two speeds
(or the two TPOTs) where a source gave both, and each record names the file's own source.
It prints the counts the corpus is judged by.

    python bench/published/check.py            # exit 1 and one line per problem if any
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent

ROW_KEYS = {
    "source", "url", "quote", "target", "arch", "quant", "gpu", "gpu_count", "tp", "ep",
    "interconnect", "engine", "engine_version", "cuda_graphs", "batch", "batch_kind",
    "input_len", "output_len", "method", "shape", "accept_length", "plain_tok_s", "spec_tok_s",
    "tok_s_kind", "plain_tpot_ms", "spec_tpot_ms", "speedup", "notes",
}
ARCH_KEYS = {
    "family", "params_b", "active_params_b", "layers", "hidden", "heads", "kv_heads",
    "head_dim", "vocab", "moe", "attention",
}
MOE_KEYS = {"experts", "active", "expert_intermediate"}
# Optional: the layers whose MLP is dense instead of routed (interleaved or leading), and its width.
MOE_OPTIONAL = {"dense_layers", "dense_intermediate"}
SHAPE_KEYS = {"num_steps", "topk", "num_draft_tokens"}
ENGINES = {"vllm", "sglang", "tensorrt-llm", "eagle-reference", "tokenspeed", "llama.cpp"}
BATCH_KINDS = {"batch", "concurrency"}
TOK_S_KINDS = {"per_request", "total"}
ATTENTION = {"mha", "gqa", "mla"}
INTERCONNECT = {"nvlink", "pcie", None}
# Speed-up recomputed from the two speeds may differ from the stated one by rounding only.
SPEEDUP_TOLERANCE = 0.02


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _positive(row: dict, key: str, where: str, problems: list[str], integer=False) -> None:
    v = row[key]
    if v is None:
        return
    if not _is_num(v) or v <= 0 or (integer and not isinstance(v, int)):
        kind = "positive integer" if integer else "positive number"
        problems.append(f"{where}: {key} must be a {kind} or null, got {v!r}")


def _check_arch(arch, where: str, problems: list[str]) -> None:
    if not isinstance(arch, dict) or set(arch) != ARCH_KEYS:
        problems.append(f"{where}: arch must have exactly the keys {sorted(ARCH_KEYS)}")
        return
    for key in ("params_b", "active_params_b", "layers", "hidden", "heads", "kv_heads",
                "head_dim", "vocab"):
        _positive(arch, key, f"{where} arch", problems, integer=key not in ("params_b",
                                                                             "active_params_b"))
    if arch["params_b"] is None or arch["layers"] is None or arch["hidden"] is None:
        problems.append(f"{where}: arch needs params_b, layers and hidden")
    if arch["attention"] not in ATTENTION:
        problems.append(f"{where}: arch.attention must be one of {sorted(ATTENTION)}")
    moe = arch["moe"]
    if moe is not None:
        if not isinstance(moe, dict) or not MOE_KEYS <= set(moe) <= MOE_KEYS | MOE_OPTIONAL:
            problems.append(f"{where}: arch.moe must be null or have keys {sorted(MOE_KEYS)} "
                            f"(and optionally {sorted(MOE_OPTIONAL)})")
        else:
            for key in set(moe):
                _positive(moe, key, f"{where} arch.moe", problems, integer=True)
            if _is_num(moe["active"]) and _is_num(moe["experts"]) and moe["active"] > moe["experts"]:
                problems.append(f"{where}: arch.moe.active exceeds experts")
        if not (_is_num(arch["active_params_b"]) and arch["active_params_b"] < arch["params_b"]):
            problems.append(f"{where}: an MoE arch needs active_params_b below params_b")


def _check_shape(shape, where: str, problems: list[str]) -> None:
    if not isinstance(shape, dict) or set(shape) != SHAPE_KEYS:
        problems.append(f"{where}: shape must have exactly the keys {sorted(SHAPE_KEYS)}")
        return
    for key in SHAPE_KEYS:
        _positive(shape, key, f"{where} shape", problems, integer=True)
    if shape["topk"] == 1 and _is_num(shape["num_steps"]) and _is_num(shape["num_draft_tokens"]):
        if shape["num_draft_tokens"] != shape["num_steps"] + 1:
            problems.append(f"{where}: a chain (topk 1) must have num_draft_tokens = steps + 1")


def _check_speeds(row: dict, where: str, problems: list[str]) -> None:
    for key in ("plain_tok_s", "spec_tok_s", "plain_tpot_ms", "spec_tpot_ms", "speedup"):
        _positive(row, key, where, problems)
    has_tok_s = row["plain_tok_s"] is not None and row["spec_tok_s"] is not None
    has_tpot = row["plain_tpot_ms"] is not None and row["spec_tpot_ms"] is not None
    if row["speedup"] is None:
        problems.append(f"{where}: speedup is missing")
        return
    if (row["plain_tok_s"] is None) != (row["spec_tok_s"] is None):
        problems.append(f"{where}: plain_tok_s and spec_tok_s come as a pair")
    if (row["plain_tpot_ms"] is None) != (row["spec_tpot_ms"] is None):
        problems.append(f"{where}: plain_tpot_ms and spec_tpot_ms come as a pair")
    if has_tok_s != (row["tok_s_kind"] in TOK_S_KINDS):
        problems.append(f"{where}: tok_s_kind must be one of {sorted(TOK_S_KINDS)} exactly "
                        "when the tok/s pair is given")
    ratios = []
    if has_tok_s:
        ratios.append(("tok/s", row["spec_tok_s"] / row["plain_tok_s"]))
    if has_tpot:
        ratios.append(("TPOT", row["plain_tpot_ms"] / row["spec_tpot_ms"]))
    for name, ratio in ratios:
        if abs(ratio / row["speedup"] - 1) > SPEEDUP_TOLERANCE:
            problems.append(f"{where}: speedup {row['speedup']} disagrees with the {name} pair "
                            f"({ratio:.3f})")


def check_row(row, source_id: str, where: str) -> list[str]:
    """Every problem with one record, each as one line naming `where`."""
    if not isinstance(row, dict):
        return [f"{where}: a row must be an object"]
    problems = []
    if set(row) != ROW_KEYS:
        missing, extra = sorted(ROW_KEYS - set(row)), sorted(set(row) - ROW_KEYS)
        return [f"{where}: keys differ from the schema (missing {missing}, extra {extra})"]
    if row["source"] != source_id:
        problems.append(f"{where}: source {row['source']!r} is not the file's id {source_id!r}")
    for key in ("url", "quote", "target", "method", "notes"):
        if not isinstance(row[key], str) or not row[key].strip():
            problems.append(f"{where}: {key} must be a non-empty string")
    for key in ("quant", "engine_version", "gpu"):
        if row[key] is not None and not isinstance(row[key], str):
            problems.append(f"{where}: {key} must be a string or null")
    if row["engine"] not in ENGINES:
        problems.append(f"{where}: engine must be one of {sorted(ENGINES)}")
    if row["batch_kind"] not in BATCH_KINDS:
        problems.append(f"{where}: batch_kind must be one of {sorted(BATCH_KINDS)}")
    if row["interconnect"] not in INTERCONNECT:
        problems.append(f"{where}: interconnect must be nvlink, pcie or null")
    if row["cuda_graphs"] not in (True, False, None):
        problems.append(f"{where}: cuda_graphs must be true, false or null")
    for key in ("gpu_count", "tp", "ep", "batch", "input_len", "output_len"):
        _positive(row, key, where, problems, integer=True)
    if row["batch"] is None or row["gpu_count"] is None:
        problems.append(f"{where}: batch and gpu_count are required")
    _positive(row, "accept_length", where, problems)
    if _is_num(row["accept_length"]) and row["accept_length"] < 1:
        problems.append(f"{where}: accept_length counts the bonus token, so it is at least 1")
    _check_arch(row["arch"], where, problems)
    _check_shape(row["shape"], where, problems)
    _check_speeds(row, where, problems)
    return problems


def load_corpus(folder: Path = HERE) -> tuple[list[dict], list[str]]:
    """All rows of every source file in `folder`, and every problem found."""
    rows, problems = [], []
    files = sorted(folder.glob("*.json"))
    if not files:
        return rows, [f"{folder}: no source files"]
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            problems.append(f"{path.name}: not valid JSON ({e})")
            continue
        if not isinstance(data, list) or not data:
            problems.append(f"{path.name}: must hold a non-empty list of rows")
            continue
        for i, row in enumerate(data):
            problems += check_row(row, path.stem, f"{path.name} row {i}")
            if isinstance(row, dict):
                rows.append(row)
    index = (folder / "README.md").read_text() if (folder / "README.md").exists() else ""
    problems += _check_index(index, Counter(r.get("source") for r in rows), [p.stem for p in files])
    return rows, problems


def _check_index(index: str, counts: Counter, ids: list[str]) -> list[str]:
    """Every source has one index line in README.md whose last cell is its row count."""
    listed = {}
    for line in index.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 1 and cells[0].startswith("`") and cells[0].endswith("`"):
            listed[cells[0].strip("`")] = cells[-1]
    problems = []
    for sid in ids:
        if sid not in listed:
            problems.append(f"README.md: source {sid!r} is not in the index")
        elif listed[sid] != str(counts[sid]):
            problems.append(f"README.md: source {sid!r} lists {listed[sid]} rows, its file has {counts[sid]}")
    return problems


def summarize(rows: list[dict]) -> dict:
    """The counts the corpus is judged by."""
    batches = [r["batch"] for r in rows if _is_num(r.get("batch"))]
    return {
        "rows": len(rows),
        "sources": len({r["source"] for r in rows}),
        "engines": dict(Counter(r["engine"] for r in rows)),
        "dense_rows": sum(1 for r in rows if r["arch"]["moe"] is None),
        "moe_rows": sum(1 for r in rows if r["arch"]["moe"] is not None),
        "batch_min": min(batches, default=None),
        "batch_max": max(batches, default=None),
        "gpus": dict(Counter(r["gpu"] for r in rows)),
        "methods": dict(Counter(r["method"] for r in rows)),
    }


def main() -> int:
    rows, problems = load_corpus()
    for line in problems:
        print(line)
    s = summarize(rows)
    print(f"{s['rows']} rows from {s['sources']} sources; engines {s['engines']}")
    print(f"dense rows {s['dense_rows']}, MoE rows {s['moe_rows']}, "
          f"batch/concurrency {s['batch_min']}..{s['batch_max']}")
    print(f"GPUs {s['gpus']}")
    print(f"methods {s['methods']}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
