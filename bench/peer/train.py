"""speculators' trainer (`speculators train`), as its CLI runs it, with three additions:

    python bench/peer/train.py --metrics FILE.jsonl [speculators train flags ...]

- the "hf" hidden-states backend (hf_backend.py) is registered: `--hidden-states-backend hf`;
- every metrics record it logs goes to FILE as a JSON line with its time, then a last line
  {"done": true, "wall_s": ...};
- with no accelerator, the model and batches go to "cpu" instead of `get_local_rank()` (an
  accelerator index), and torch.accelerator.synchronize() is a no-op.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time

import torch

importlib.import_module("hf_backend")  # registers --hidden-states-backend hf before speculators reads its flags


class MetricsFile(logging.Handler):
    """Metrics records (dicts logged on `speculators.metrics`) to a JSONL file; everything else
    speculators logs, and any warning, to stderr. On the root logger before speculators sets up
    its own, so its console handler is not added and nothing prints twice."""

    def __init__(self, path: str):
        super().__init__()
        self.file = open(path, "a", encoding="utf-8")

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("speculators.metrics") and isinstance(record.msg, dict):
            if not getattr(record, "hparams", False):  # the resolved config, logged once: not a metric
                self.file.write(json.dumps({"time": record.created, **record.msg}, default=float) + "\n")
                self.file.flush()
        elif record.name.startswith("speculators") or record.levelno >= logging.WARNING:
            print(f"[{record.name}] {record.getMessage()}", file=sys.stderr)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--metrics", required=True, help="JSONL file the metrics records are appended to")
    ours, rest = p.parse_known_args(argv)
    handler = MetricsFile(ours.metrics)
    logging.getLogger().addHandler(handler)
    if not torch.accelerator.is_available():
        import speculators.train.trainer as trainer
        trainer.get_local_rank = lambda: "cpu"
        torch.accelerator.synchronize = lambda *a, **k: None
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(rest)
    t0 = time.perf_counter()
    train_main(cfg)
    handler.file.write(json.dumps({"time": time.time(), "done": True, "wall_s": time.perf_counter() - t0}) + "\n")
    handler.file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
