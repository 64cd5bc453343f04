"""fledge's tokenized samples -> the dataset speculators' trainer reads, so both train on the
same ids and loss masks.

    python bench/peer/dataset.py TRAIN.jsonl HELDOUT.jsonl OUT_DIR

The inputs are `fledge tokenize` rows ({"input_ids", "loss_mask"}), every row taken. OUT_DIR is
what `speculators prepare-data` writes (columns input_ids, loss_mask, seq_len), the training rows
then the held-out ones. speculators validates on the tail from int(rows * train_data_ratio): the
last line printed (JSON) gives the ratio that cuts exactly between the files, with the row counts.
Runs in speculators' environment (needs `datasets`).
"""

from __future__ import annotations

import json
import sys


def samples(path: str):
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
