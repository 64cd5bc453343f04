"""CUDA-graph capture, pinned host copies that lag the device by a few steps, and a synchronising clock:
the GPU plumbing that plain, streamed and speculative decoding share."""

from __future__ import annotations

import time

import torch


# --------------------------------------------------------------------------- CUDA graphs
def capture_cuda_graph(fn, reset=None, warmup: int = 3):
    """Capture `fn()` — which must read only static buffers — and return a replay that
    returns fn's (static) output. fn runs `warmup` times on a side stream first, as capture
    requires; it must therefore be idempotent (a decode step rewrites the same cache slot), or
    `reset()` must undo what a run changed (it is called before each of those runs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            if reset is not None:
                reset()
            fn()
        if reset is not None:  # capture only records: what the warm-up changed is undone here
            reset()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    # A graph's first replay also uploads it to the device: do that here, before any clock.
    if reset is not None:
        reset()
    graph.replay()
    if reset is not None:
        reset()

    def replay():
        graph.replay()
        return out

    return replay


class PinnedCopies:
    """Copies of a device tensor taken behind the work queued on the stream, for the host to read
    later, oldest first, with one sync each: the host reads step i while the device runs step
    i+1. `depth` buffers (pinned on CUDA), so at most `depth` copies are unread."""

    def __init__(self, like: torch.Tensor, depth: int):
        self.cuda = like.device.type == "cuda"
        self.bufs = [torch.empty(like.shape, dtype=like.dtype, pin_memory=self.cuda) for _ in range(depth)]
        self.pending, self.count = [], 0  # (buffer, event) per unread copy, oldest first

    def __len__(self) -> int:
        return len(self.pending)

    def push(self, src: torch.Tensor) -> None:
        buf = self.bufs[self.count % len(self.bufs)]
        buf.copy_(src, non_blocking=self.cuda)
        event = torch.cuda.Event() if self.cuda else None
        if event is not None:
            event.record()
        self.pending.append((buf, event))
        self.count += 1

    def pop(self) -> torch.Tensor:
        buf, event = self.pending.pop(0)
        if event is not None:
            event.synchronize()
        return buf


def now(device) -> float:
    """The host clock once `device` has run everything queued on it: the clock fledge's step timings read."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
