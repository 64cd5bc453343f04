"""Eagle3Draft against a brute-force, head-by-head re-implementation of the same step."""

import math

import pytest
import torch
from conftest import make_tiny

from fledge.core.config import DraftConfig
from fledge.core.errors import FledgeError
from fledge.drafter.eagle3 import Eagle3Draft

# The EAGLE-3 layer and EAGLE-3.1's two changes, alone and together: (fc_norm, norm_output).
LAYERS = [(False, False), (True, False), (False, True), (True, True)]


def _draft(seed=0, family="llama", draft_vocab=100, fc_norm=False, norm_output=False):
    target = make_tiny(family, seed=seed)
    cfg = DraftConfig.from_target(target.config, draft_vocab_size=draft_vocab).replace(
        fc_norm=fc_norm, norm_output=norm_output)
    torch.manual_seed(seed + 1)
    ids = torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values
    d = Eagle3Draft.from_target(cfg, target, ids)
    for p in d.parameters():  # norms start at ones; randomise so a swapped norm would show
        if p.requires_grad:
            p.data.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    return target, d


def _rms(x, w, eps):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _brute(d, ids, aux, pos):
    """Causal one-layer step for a single sequence, written from the formulas."""
    cfg, L = d.cfg, d.midlayer
    eps = cfg.rms_norm_eps
    if cfg.fc_norm:
        aux = torch.cat([_rms(x, n.weight, eps) for n, x in zip(d.fc_norm, aux.chunk(3, -1))], -1)
    h = aux @ d.fc.weight.T
    a = torch.cat([_rms(d.embed_tokens.weight[ids], L.input_layernorm.weight, eps),
                   _rms(h, L.hidden_norm.weight, eps)], -1)
    T, hd = ids.shape[0], cfg.head_dim
    q = (a @ L.self_attn.q_proj.weight.T).view(T, -1, hd)
    k = (a @ L.self_attn.k_proj.weight.T).view(T, -1, hd)
    v = (a @ L.self_attn.v_proj.weight.T).view(T, -1, hd)
    outs = []
    for head in range(cfg.num_attention_heads):
        kv = head // (cfg.num_attention_heads // cfg.num_key_value_heads)
        qh, kh = _rope(q[:, head], pos, cfg.rope_theta), _rope(k[:, kv], pos, cfg.rope_theta)
        s = qh @ kh.T / math.sqrt(hd)
        s = s.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        outs.append(s.softmax(-1) @ v[:, kv])
    h = h + torch.cat(outs, -1) @ L.self_attn.o_proj.weight.T
    m = _rms(h, L.post_attention_layernorm.weight, eps)
    m = (torch.nn.functional.silu(m @ L.mlp.gate_proj.weight.T) * (m @ L.mlp.up_proj.weight.T)) @ L.mlp.down_proj.weight.T
    out = h + m
    if cfg.norm_output:  # the next step reads the normed state, and lm_head reads it as it is
        out = _rms(out, d.norm.weight, eps)
        return out, out @ d.lm_head.weight.T
    return out, _rms(out, d.norm.weight, eps) @ d.lm_head.weight.T


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("fc_norm,norm_output", LAYERS)
def test_step_matches_brute_force(seed, fc_norm, norm_output):
    _, d = _draft(seed, fc_norm=fc_norm, norm_output=norm_output)
    T, H = 7, d.cfg.hidden_size
    ids = torch.randint(0, d.cfg.vocab_size, (1, T))
    aux = torch.randn(1, T, 3 * H)
    pos = torch.arange(3, 3 + T)[None]  # an offset start catches position mix-ups
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        out, _ = d(ids, aux, pos, mask)
        ref_out, ref_logits = _brute(d, ids[0], aux[0], pos[0])
    torch.testing.assert_close(out[0], ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(d.logits(out)[0], ref_logits, atol=1e-5, rtol=1e-5)


def test_added_fc_norm_computes_what_it_did_at_its_scales():
    """add_fc_norm on an EAGLE-3 draft: where each aux state's RMS equals its norm's scale the
    step is unchanged; elsewhere the norms act (the states are rescaled to those RMS)."""
    _, d = _draft(3)
    T, H = 6, d.cfg.hidden_size
    ids, pos = torch.randint(0, d.cfg.vocab_size, (1, T)), torch.arange(T)[None]
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    scales = torch.tensor([0.5, 3.0, 40.0])
    unit = torch.randn(1, T, 3, H)
    unit = unit / unit.pow(2).mean(-1, keepdim=True).sqrt()  # RMS 1 per token and state
    at_scales = (unit * scales[:, None]).flatten(2)
    twice = (unit * 2 * scales[:, None]).flatten(2)
    with torch.no_grad():
        before = d(ids, at_scales, pos, mask)[0]
        before_twice = d(ids, twice, pos, mask)[0]
        d.add_fc_norm(scales)
        assert d.cfg.fc_norm and [n.weight.unique().item() for n in d.fc_norm] == scales.tolist()
        torch.testing.assert_close(d(ids, at_scales, pos, mask)[0], before, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(d(ids, twice, pos, mask)[0], before, atol=1e-5, rtol=1e-5)
    assert (before_twice - before).abs().max() > 1e-2
    with pytest.raises(FledgeError, match="already has fc_norm"):
        d.add_fc_norm(scales)


def test_incremental_keys_equal_full_sequence():
    _, d = _draft(3)
    T, H = 6, d.cfg.hidden_size
    ids = torch.randint(0, d.cfg.vocab_size, (2, T))
    aux = torch.randn(2, T, 3 * H)
    pos = torch.arange(T).expand(2, T)
    full_mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(2, 1, T, T)
    with torch.no_grad():
        full, _ = d(ids, aux, pos, full_mask)
        first, kv = d(ids[:, :4], aux[:, :4], pos[:, :4], full_mask[:, :, :4, :4])
        rest, _ = d(ids[:, 4:], aux[:, 4:], pos[:, 4:], full_mask[:, :, 4:, :], past_kv=kv)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, atol=1e-5, rtol=1e-5)


def test_served_parameter_names_and_frozen_embedding():
    target, d = _draft(0)
    keys = set(d.state_dict())
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"}
    expected |= {f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    expected |= {f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"}
    expected |= {f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert keys == expected
    H = d.cfg.hidden_size
    assert d.midlayer.self_attn.q_proj.weight.shape[1] == 2 * H and d.fc.weight.shape == (H, 3 * H)
    assert not d.embed_tokens.weight.requires_grad
    assert torch.equal(d.embed_tokens.weight, target.get_input_embeddings().weight)
    assert d.lm_head.weight.shape[0] == 100 and d.t2d.sum() == 100
    assert torch.equal(d.target_ids(), d.t2d.nonzero().flatten())


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_head_init_takes_the_targets_output_side(family):
    """lm_head = the target's output rows of the draft vocab; norm = the target's final norm as
    a plain RMSNorm weight (Gemma stores weight - 1): after the copy, the draft's norm + head on
    any state give the target's own logits at the draft vocab."""
    target, d = _draft(4, family)
    with torch.no_grad():
        target.get_decoder().norm.weight.normal_(0, 0.5)  # fresh norms are all ones (zeros in Gemma)
    d.init_head_from(target)
    x = torch.randn(3, d.cfg.hidden_size)
    want = target.lm_head(target.get_decoder().norm(x))[:, d.target_ids()]
    torch.testing.assert_close(d.logits(x), want, rtol=1e-4, atol=1e-4)


def test_head_init_refuses_a_target_without_a_final_norm():
    """A target whose decoder has no `.norm.weight` is refused before anything is copied."""
    target, d = _draft(4)
    target.get_decoder().norm = torch.nn.Identity()
    head = d.lm_head.weight.clone()
    with pytest.raises(FledgeError, match="no final norm"):
        d.init_head_from(target)
    assert torch.equal(d.lm_head.weight, head)
