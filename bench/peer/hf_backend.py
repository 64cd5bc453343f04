"""A hidden-states backend for speculators' trainer, "hf": the target runs in-process with HF
transformers whenever the data loader asks for a sample, so training needs neither a vLLM
server nor feature files on disk.

Row i gives what vLLM's hidden-state extraction writes (`hs_connectors`' transfer API):
`token_ids` [T] and `hidden_states` [T, len(aux)+1, H], the residual stream entering each aux
layer, then the last layer's output before the final norm (speculators applies the norm and head
itself), captured by forward pre-hooks as vLLM does. Imported by bench/peer/train.py.
"""

from __future__ import annotations

import torch
from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer


class HFTransfer(HiddenStatesTransfer):
    def __init__(self, data_path: str, model_path: str, layer_ids: list[int], dtype: str | None):
        self.data_path, self.model_path, self.layer_ids, self.dtype = str(data_path), model_path, list(layer_ids), dtype
        self.model = self.rows = self.device = None

    def __getstate__(self):
        # Data loader workers start by spawn: each gets the recipe and loads its own copy.
        return {**self.__dict__, "model": None, "rows": None}

    def _load(self) -> None:
        from datasets import load_from_disk
        from transformers import AutoModelForCausalLM

        self.device = torch.accelerator.current_accelerator() or torch.device("cpu")
        dtype = getattr(torch, self.dtype or ("float32" if self.device.type == "cpu" else "bfloat16"))
        self.rows = load_from_disk(self.data_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(self.device).eval()

    @torch.no_grad()
    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor]:
        if self.model is None:
            self._load()
        ids = torch.as_tensor(self.rows[file_idx]["input_ids"], dtype=torch.long)
        decoder = self.model.get_decoder()
        seen = {}

        def keep(key):
            def hook(module, args, kwargs):
                seen[key] = args[0] if args else kwargs["hidden_states"]
            return hook

        n = len(decoder.layers)
        modules = [(L, decoder.layers[L] if L < n else decoder.norm) for L in self.layer_ids] + [("final", decoder.norm)]
        handles = [m.register_forward_pre_hook(keep(key), with_kwargs=True) for key, m in modules]
        try:
            decoder(input_ids=ids[None].to(self.device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        states = torch.stack([seen[L][0] for L in self.layer_ids] + [seen["final"][0]], 1)
        return {"token_ids": ids, "hidden_states": states.cpu()}

    def get_generated(self, hs_transfer_params):
        return None


@HiddenStatesBackend.register("hf")
class HFBackend(HiddenStatesBackend):
    @staticmethod
    def add_train_args(parser) -> None:
        parser.add_argument("--hf-target-dtype", default=None,
                            help="hf backend: the target's dtype (default bfloat16 with an accelerator, else float32)")

    @staticmethod
    def add_launch_args(parser) -> None:
        pass

    @staticmethod
    def from_train_args(args, data_path):
        from speculators.models.utils import resolve_target_layer_ids

        ids = resolve_target_layer_ids(args.target_layer_ids, args.verifier_name_or_path)
        return HFTransfer(data_path, args.verifier_name_or_path, ids, args.hf_target_dtype)

    @staticmethod
    def build_kv_transfer_config(args):
        raise NotImplementedError("the hf backend starts no vLLM server")
