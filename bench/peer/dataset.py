"""fledge's tokenized samples -> the dataset speculators' trainer reads, so both train on the
same ids and loss masks.

    python bench/peer/dataset.py TRAIN.jsonl HELDOUT.jsonl OUT_DIR

The inputs are what `fledge tokenize` writes ({"input_ids", "loss_mask"} a line), every row
taken: bench/peer_compare.py gives it the samples fledge's own loader keeps.

OUT_DIR is what `speculators prepare-data` writes (`datasets` save_to_disk, torch format,
columns input_ids, loss_mask, seq_len): the training rows first, then the held-out rows, each in
file order. speculators' validation split is the dataset's tail, cut at int(rows *
train_data_ratio); the last line printed (JSON) gives the ratio that makes that cut fall exactly
between the two files, with the row counts. Runs in speculators' environment (needs `datasets`).
"""

from __future__ import annotations

import json
import sys


def samples(path: str):
    """(input_ids, loss_mask) of every sample in a tokenized JSONL, in file order."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                yield rec["input_ids"], [int(m) for m in rec["loss_mask"]]


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    from datasets import Dataset

    train, heldout, out = argv
    cols = {"input_ids": [], "loss_mask": [], "seq_len": []}
    counts = {}
    for name, path in (("train", train), ("heldout", heldout)):
        counts[name] = 0
        for ids, mask in samples(path):
            cols["input_ids"].append(ids)
            cols["loss_mask"].append(mask)
            cols["seq_len"].append(len(ids))
            counts[name] += 1
    Dataset.from_dict(cols).with_format("torch").save_to_disk(out)
    total = counts["train"] + counts["heldout"]
    # int(total * ratio) == train rows: half a row above the boundary, clear of rounding.
    print(json.dumps({**counts, "train_data_ratio": (counts["train"] + 0.5) / total}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
