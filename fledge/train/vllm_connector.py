"""A vLLM KV connector that writes each request's captured hidden states on any device, the CPU
included. Runs inside vLLM's Python (loaded by `kv_connector_module_path`), never in fledge's.

vLLM's `extract_hidden_states` method keeps the aux layers' states of every prompt token in a
cache-only layer; its example connector copies them out through pinned host memory and CUDA
streams, which a CPU build does not have. This subclass keeps the example's scheduler side,
file format ({"hidden_states": [T, layers, H], "token_ids": [T]}, plus "layer_ids": the layers
captured, in vLLM's numbering) and per-file lock, and copies synchronously instead.

Launch line (fledge prints the full one: `fledge features --print-launch`):
    --kv-transfer-config '{"kv_connector": "CPUHiddenStatesConnector",
        "kv_connector_module_path": "fledge.train.vllm_connector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": DIR}}'
with fledge importable by the server (PYTHONPATH naming the directory above the package).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands where the example keeps a CUDA event: the copy finished before it was made."""

    @staticmethod
    def query() -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        # Written beside the states, so a client can tell which layers it got.
        hf = vllm_config.speculative_config.draft_model_config.hf_config
        self._layer_ids = torch.tensor(list(hf.eagle_aux_hidden_state_layer_ids), dtype=torch.int64)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:  # one copy of the states: rank 0's
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0])
        tensors = {"hidden_states": states.to("cpu").contiguous(), "token_ids": pending.token_ids.clone(),
                   "layer_ids": self._layer_ids}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            # Written under a temporary name, then renamed: a reader that skips the lock never
            # sees half a file.
            tmp = f"{pending.filename}.part"
            save_file(tensors, tmp)
            os.replace(tmp, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the writer's lock: readers waiting on it go on
        self._req_copy_events[pending.req_id] = _Done()
