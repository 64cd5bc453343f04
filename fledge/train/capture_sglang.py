"""The target's features from an SGLang server: the same interface as capture.VllmCapture.

SGLang documents one way to get states out of a server: `--enable-return-hidden-states` and
`"return_hidden_states": true` on `/generate`, whose reply carries `meta_info.hidden_states`, a
list whose first entry holds one row per prompt token (the prefill), then one per generated
token. Stock SGLang fills each row with the final-norm state alone (width H): too little for
EAGLE-3, which needs the aux layers too; those come only from a capture patch (SpecForge's),
whose rows fledge reads as [aux_1, aux_2, aux_3, final-norm state] (width 4H).

SGLang names the aux layers by the layer whose *output* they are: its id k is fledge's
canonical k+1 (core.conventions.aux_ids_to_sglang), recorded in meta.json in both spellings.
"""

from __future__ import annotations

import torch

from fledge.core.conventions import aux_ids_to_sglang
from fledge.core.errors import FledgeError
from fledge.core.openai_client import ServerError, with_retries
from fledge.train.capture import ServerCapture


class SglangCapture(ServerCapture):
    """Features from an SGLang server's /generate with return_hidden_states; its rows hold the
    state after the final norm, so `norm` goes unused."""

    def engine(self) -> dict:
        try:
            info = with_retries(lambda k: self.client.root_json("/get_model_info"), self.retries, 1.0)
        except ServerError as e:
            raise FledgeError(f"{self.url}: cannot reach the SGLang server ({e.problem})") from None
        served = str(info.get("model_path", "")) if isinstance(info, dict) else ""
        if served and self.model not in (served, served.rstrip("/").split("/")[-1]):
            raise FledgeError(f"{self.url} serves {served!r}, not {self.model!r}: a server for another model "
                              "(or pass --served-name)")
        return {"name": "sglang", "version": str(info.get("version", "unknown")),
                "layer_ids": list(aux_ids_to_sglang(self.aux_ids, self.num_layers)),
                "final_state": "post-norm (as SGLang returns it)"}

    def one(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        body = {"input_ids": ids, "return_hidden_states": True,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        try:
            reply = with_retries(lambda k: self.client.root_json("/generate", body), self.retries, 1.0)
        except ServerError as e:
            raise FledgeError(f"{self.url}: capture request failed ({e.problem})") from None
        meta = reply.get("meta_info") if isinstance(reply, dict) else None
        states = (meta or {}).get("hidden_states")
        if not states:
            raise FledgeError(f"{self.url}: the reply holds no hidden_states; start SGLang with "
                              "--enable-return-hidden-states (and a capture patch for the aux layers)")
        if meta.get("prompt_tokens", len(ids)) != len(ids):
            raise FledgeError(f"{self.url}: the server read {meta['prompt_tokens']} prompt tokens, {len(ids)} were sent")
        rows = torch.tensor(states[0], dtype=torch.float32)
        h = self.hidden_size
        if rows.dim() != 2 or rows.shape[1] not in (h, 4 * h):
            raise FledgeError(f"{self.url}: hidden-state rows of shape {list(rows.shape)}, expected [T, {4 * h}] "
                              f"(another model, or other captured layers)")
        if rows.shape[1] == h:
            raise FledgeError(f"{self.url}: the server returns only the final state (width {h}); EAGLE-3 needs the aux "
                              "layers too, which SGLang returns only under a capture patch")
        if rows.shape[0] != len(ids):
            raise FledgeError(f"{self.url}: states for {rows.shape[0]} tokens, the sample has {len(ids)}: disable the "
                              "radix cache (--disable-radix-cache) and chunked prefill (--chunked-prefill-size -1)")
        return rows[:, :3 * h], rows[:, 3 * h:]
