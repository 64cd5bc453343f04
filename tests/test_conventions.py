import pytest
import torch

from fledge.core import conventions as cv
from fledge.core.errors import FledgeError


@pytest.mark.parametrize("n", [8, 24, 30, 32, 61])
def test_default_aux_ids_match_both_engines(n):
    ids = cv.default_aux_layer_ids(n)
    assert ids == (2, n // 2, n - 3)                      # vLLM's default
    assert cv.aux_ids_to_sglang(ids, n) == (1, n // 2 - 1, n - 4)  # SGLang/SpecForge default
    assert cv.aux_ids_from_sglang(cv.aux_ids_to_sglang(ids, n), n) == ids


def test_kimi_k2_aux_layers():
    # Kimi-K2 logs show layers 2, 30, 58 feeding a 3x7168 fc.
    assert cv.default_aux_layer_ids(61) == (2, 30, 58)


@pytest.mark.parametrize("ids", [(0, 3, 5), (2, 4, 8), (4, 2, 5), (2, 2, 5), (1, 2), (1, 2, 3, 4)])
def test_bad_aux_ids(ids):
    with pytest.raises(FledgeError):
        cv.validate_aux_layer_ids(ids, 8)


def test_any_number_of_aux_ids_where_a_capture_or_dflash_reads_them():
    assert cv.validate_aux_layer_ids((1, 2, 4, 6, 7), 8, count=None) == (1, 2, 4, 6, 7)
    assert cv.validate_aux_layer_ids([5], 8, count=None) == (5,)
    for bad in [(), (0, 3), (2, 8), (4, 2), (3, 3)]:
        with pytest.raises(FledgeError):
            cv.validate_aux_layer_ids(bad, 8, count=None)
    with pytest.raises(FledgeError, match="exactly three"):
        cv.validate_aux_layer_ids((1, 2, 4, 6, 7), 8)  # EAGLE-3's default count


def test_d2t_round_trip_random():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        vocab = int(torch.randint(10, 5000, (1,), generator=g))
        n = int(torch.randint(1, vocab, (1,), generator=g))
        ids = torch.randperm(vocab, generator=g)[:n].sort().values
        d2t = cv.d2t_from_target_ids(ids, vocab)
        assert d2t.dtype == torch.int64
        assert torch.equal(torch.arange(n) + d2t, ids)  # target = i + d2t[i]
        assert torch.equal(torch.from_numpy(cv.target_ids_from_d2t(d2t, vocab)), ids)
        t2d = cv.t2d_from_target_ids(ids, vocab)
        assert t2d.sum() == n and bool(t2d[ids].all())


def test_d2t_rejects_bad_maps():
    with pytest.raises(FledgeError):
        cv.d2t_from_target_ids(torch.tensor([3, 1, 2]), 10)   # not ascending
    with pytest.raises(FledgeError):
        cv.d2t_from_target_ids(torch.tensor([1, 10]), 10)     # out of range
    with pytest.raises(FledgeError):
        cv.target_ids_from_d2t(torch.tensor([1, 0]), 10)      # 0->1, 1->1: two draft ids, one target
    with pytest.raises(FledgeError):
        cv.target_ids_from_d2t(torch.tensor([0, 9]), 10)      # 1 -> 10 out of range


def test_accept_length_definitions():
    # 10 verify steps, 25 accepted drafts: 3.5 tokens per step counting the bonus token.
    assert cv.accept_length(25, 10) == 3.5
    assert cv.accept_length(0, 10) == 1.0                    # no gain
    assert cv.accept_rate(25, 10, 8) == 25 / 70


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}, {"type": "linear", "factor": 2.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_fields_read_both_spellings_as_hf_does(scaling):
    """An engine-style file (rope_theta + rope_scaling, maybe the legacy `type`) and the
    `rope_parameters` transformers makes of it give the same theta and scaling."""
    import copy

    import transformers

    legacy = {"rope_theta": 5e5, **({"rope_scaling": scaling} if scaling else {})}
    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                                  **copy.deepcopy(legacy))  # it writes rope_theta into the scaling dict
    want = (5e5, None if scaling is None else {"rope_type": "linear" if "type" in scaling else scaling["rope_type"],
                                               **{k: v for k, v in scaling.items() if k not in ("type", "rope_type")}})
    assert cv.rope_fields(legacy) == want
    assert cv.rope_fields(hf.to_dict()) == want


def test_rope_fields_defaults_and_precedence():
    assert cv.rope_fields({}) == (cv.ROPE_THETA_DEFAULT, None)
    assert cv.rope_fields({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == (1e6, None)
    both = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
            "rope_theta": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert cv.rope_fields(both) == (1e6, {"rope_type": "yarn", "factor": 4.0})
