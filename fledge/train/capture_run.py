"""`fledge features --server URL` (capture into shards) and `fledge train --features URL`
(stream features batch by batch, nothing on disk): the target is read from its config and
checkpoint alone (shapes, tokenizer vocab, final norm), never loaded whole.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import transformers

from fledge.core.conventions import default_aux_layer_ids, validate_aux_layer_ids
from fledge.core.devices import pick_device
from fledge.core.errors import FledgeError
from fledge.core.files import output_lock
from fledge.core.target import load_target, resolve_target
from fledge.data.tokenize import check_tokenized, load_tokenizer
from fledge.train.capture import FinalNorm, VllmCapture, launch_args, launch_line
from fledge.train.features import (
    FeatureOptions,
    Sample,
    ServerFeatures,
    aux_layer_ids_for,
    features_meta,
    load_samples,
    pad_features,
    summary_line,
    write_features,
    write_source_features,
)


@dataclass(frozen=True)
class TargetShape:
    path: Path
    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def read(cls, spec: str) -> "TargetShape":
        path = resolve_target(spec)
        cfg = transformers.AutoConfig.from_pretrained(path).get_text_config()
        return cls(path, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size)


def aux_ids_of(shape: TargetShape, aux_layers) -> tuple:
    n = shape.num_layers
    return validate_aux_layer_ids(aux_layers, n, count=None) if aux_layers else default_aux_layer_ids(n)


def make_capture(engine: str, url: str, name: str, shape: TargetShape, aux_ids, **opts):
    norm = FinalNorm.from_target_dir(shape.path)
    if engine == "sglang":
        from fledge.train.capture_sglang import SglangCapture
        return SglangCapture(url, name, aux_ids, shape.num_layers, shape.hidden_size, norm, **opts)
    return VllmCapture(url, name, aux_ids, shape.num_layers, shape.hidden_size, norm, **opts)


def run_features(args) -> int:
    """`fledge features`: from the target in this process, or from a capture server."""
    opts = FeatureOptions(args.dtype, args.shard_size, args.batch_size, args.device or "cpu")
    if not args.print_launch and not (args.data and args.out):
        raise FledgeError("fledge features needs --data and --out (or --print-launch)")
    if args.print_launch:
        return run_capture(args, opts)
    with output_lock(args.out):  # one writer per feature directory
        if args.server:
            return run_capture(args, opts)
        device = pick_device(args.device)  # before a load of minutes
        target = load_target(args.target, device=device)
        model = target.model
        check_tokenized(args.data, target.tokenizer, args.target)
        samples = load_samples(args.data, args.max_len, model.config.get_text_config().vocab_size)
        aux_ids = aux_layer_ids_for(model, args.aux_layers)
        summary = write_features(model, aux_ids, samples, args.out,
                                 features_meta(target.name, args.data, args.max_len), replace(opts, device=device))
    print(summary_line(summary, args.out))
    return 0


def run_capture(args, opts: FeatureOptions) -> int:
    shape = TargetShape.read(args.target)
    aux_ids = aux_ids_of(shape, args.aux_layers)
    name = args.served_name or args.target
    if args.print_launch:
        storage = Path(args.storage or "/tmp/fledge-hidden-states")
        print(launch_line(launch_args(shape.path, name, aux_ids, shape.num_layers, storage, args.max_len + 1)))
        return 0
    check_tokenized(args.data, load_tokenizer(args.target, template_needed=False), args.target)
    samples = load_samples(args.data, args.max_len, shape.vocab_size)
    capture = make_capture(args.engine, args.server, name, shape, aux_ids, timeout=args.timeout,
                           retries=args.retries, concurrency=args.concurrency)
    summary = write_source_features(ServerFeatures(capture), aux_ids, samples, args.out,
                             features_meta(args.target, args.data, args.max_len), opts)
    print(summary_line(summary, args.out))
    return 0


class StreamedFeatures:
    """`FeatureStore`'s interface over a capture server: each batch's features are fetched
    while the step before trains (at most `depth` batches queued), used once and dropped."""

    def __init__(self, capture, samples: list[Sample], aux_ids, depth: int = 4):
        self.source = ServerFeatures(capture)
        self.samples = samples
        self.meta = {"aux_layer_ids": list(aux_ids), "hidden_size": capture.hidden_size, "engine": capture.engine()}
        self.depth = depth
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fledge-stream")
        self.pending: dict[tuple, Future] = {}

    def prefetch(self, indices) -> None:
        """Start fetching the samples `indices` (their `Sample.index`) unless queued or the queue is full."""
        key = tuple(indices)
        if key not in self.pending and len(self.pending) < self.depth:
            self.pending[key] = self.pool.submit(self.source.features, [self.samples[i] for i in key])

    def batch(self, indices, t: int, device):
        key = tuple(indices)
        job = self.pending.pop(key, None)
        feats = job.result() if job else self.source.features([self.samples[i] for i in key])
        return pad_features(feats, t, self.meta["hidden_size"], device)


def open_stream(url: str, target, samples: list[Sample], aux_ids) -> StreamedFeatures:
    """A stream for `fledge train --features URL`: the served model is the target's name if
    the server lists it, else the one model it serves."""
    shape = TargetShape.read(str(target.path or target.name))
    probe = make_capture("vllm", url, target.name, shape, aux_ids)
    try:
        names = probe.client.models()
    except FledgeError as e:
        raise FledgeError(f"--features {url}: cannot reach the capture server ({e})") from None
    name = target.name if target.name in names else names[0] if len(names) == 1 else target.name
    stream = StreamedFeatures(make_capture("vllm", url, name, shape, aux_ids), samples, aux_ids)
    print(f"fledge train: features streamed from {url} ({stream.meta['engine']['name']} "
          f"{stream.meta['engine']['version']}, model {name})", file=sys.stderr)
    return stream
