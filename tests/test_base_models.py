"""Targets new users bring: a template-less base model of a non-llama family (Gemma3, sliding
window) refused early in one line, then run with `--chat-template plain` or a template file
through the fallback engine path, equal to HF's own greedy decoding; a GGUF without a template
refused before any conversion; tokenized data of another tokenizer refused by vocab, features,
train and adapt; a step that reports nothing itself shown with a running clock."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import tokenizers
import torch
import transformers
from conftest import make_tiny

from fledge import cli
from fledge.core.errors import FledgeError
from fledge.core.target import PLAIN, gguf_chat_template, load_target, resolve_target
from fledge.data.tokenize import build_training_set, check_tokenized, load_tokenizer


def base_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """Word-level ids: w<i> is i, eos <eos> 1, bos <bos> 2; no chat template (a base model's)."""
    vocab = {f"w{i}": i for i in range(vocab_size)} | {"<eos>": 1, "<bos>": 2}
    del vocab["w1"], vocab["w2"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="<eos>",
                                                bos_token="<bos>")


@pytest.fixture(scope="module")
def gemma_base(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3-base")
    model = make_tiny("gemma3", seed=7)  # sliding window 8: the prompts and answers below pass it
    model.save_pretrained(d)
    base_tokenizer(model.config.vocab_size).save_pretrained(d)
    return d


def cli_run(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_base_model_is_refused_in_one_line_then_runs_plain_equal_to_hf(gemma_base, tmp_path, capsys):
    prompt = "w5 w9 w14 w3 w7 w22 w5 w9 w14"
    base = ["generate", "--target", str(gemma_base), "--prompt", prompt, "--max-new-tokens", "12", "--device", "cpu",
            "--ngram", "2", "--num-steps", "3"]
    rc, _, err = cli_run(base, capsys)
    errors = [ln for ln in err.splitlines() if "error" in ln]
    assert rc == 2 and len(errors) == 1 and "no chat template" in errors[0] and "--chat-template" in errors[0]

    rc, out, err = cli_run([*base, "--chat-template", PLAIN, "--json", str(tmp_path / "g.json")], capsys)
    assert rc == 0 and "runs through transformers' own layers with a KV cache" in err
    got = json.loads((tmp_path / "g.json").read_text())
    assert got["equal_to_plain"] is True and "output equal to plain decoding: 1/1" in out
    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma_base, dtype=torch.float32).eval()
    ids = torch.tensor([[2] + [int(w[1:]) for w in prompt.split()]])  # plain: bos, then the text
    assert got["prompt_tokens"] == ids.shape[1]
    ref = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=1, pad_token_id=1)[0, ids.shape[1]:]
    assert got["output_ids"] == ref.tolist()

    template = tmp_path / "chat_template.jinja"
    template.write_text("{% for m in messages %}w4 {{ m['content'] }} w6 {% endfor %}")
    rc, _, _ = cli_run([*base, "--chat-template", str(template), "--json", str(tmp_path / "f.json")], capsys)
    assert rc == 0 and json.loads((tmp_path / "f.json").read_text())["prompt_tokens"] == len(prompt.split()) + 2


def test_plain_mode_tokenizes_answers_with_their_end_of_text(gemma_base, tmp_path):
    """Plain text: the answer continues the prompt as written (its decoded text keeps the space
    it starts with), and is trained up to and with the end-of-text token."""
    conv = tmp_path / "c.jsonl"
    conv.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "w5 w6"},
                                                        {"role": "assistant", "content": " w7 w8"}]}) + "\n")
    with pytest.raises(FledgeError, match="no chat template"):
        load_tokenizer(str(gemma_base))
    tok = load_tokenizer(str(gemma_base), PLAIN)
    build_training_set(tok, conv, tmp_path / "t.jsonl", 64)
    rec = json.loads((tmp_path / "t.jsonl").read_text())
    assert rec["input_ids"] == [2, 5, 6, 7, 8, 1] and rec["loss_mask"] == [0, 0, 0, 1, 1, 1]


def write_gguf(path, template: str | None) -> None:
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(3000)])  # an array of strings before the template
    w.add_token_scores([0.0] * 3000)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_without_template_is_refused_before_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEDGE_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "with.gguf", "{{ messages[0]['content'] }} ✓")
    assert gguf_chat_template(tmp_path / "with.gguf") == "{{ messages[0]['content'] }} ✓"
    write_gguf(tmp_path / "base.gguf", None)
    assert gguf_chat_template(tmp_path / "base.gguf") is None
    with pytest.raises(FledgeError, match=r"base.gguf: has no chat template .*--chat-template plain"):
        load_target(str(tmp_path / "base.gguf"), chat=True)
    assert not (tmp_path / "cache").exists()  # nothing was converted


@pytest.fixture(scope="module")
def smollm_tokenized(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "c.jsonl").write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Hi there"},
                                                                   {"role": "assistant", "content": "Hello!"}]}) + "\n")
    build_training_set(load_tokenizer("smollm2-135m"), d / "c.jsonl", d / "train.tok.jsonl", 64)
    return d / "train.tok.jsonl"


def test_another_tokenizers_data_is_refused_by_vocab_features_train_and_adapt(smollm_tokenized, gemma_base, tmp_path, capsys):
    assert json.loads(smollm_tokenized.read_text())["tokenizer"].startswith("smollm2-135m#")
    check_tokenized(smollm_tokenized, transformers.AutoTokenizer.from_pretrained(resolve_target("smollm2-135m")),
                    "smollm2-135m")  # its own tokenizer passes
    rc, _, err = cli_run(["vocab", "build", str(smollm_tokenized), "--size", "8", "--target", str(gemma_base),
                          "-o", str(tmp_path / "v.safetensors")], capsys)
    errors = [ln for ln in err.splitlines() if "error" in ln]
    assert rc == 2 and len(errors) == 1 and "another vocabulary" in errors[0] and not (tmp_path / "v.safetensors").exists()

    rc, _, err = cli_run(["features", "--data", str(smollm_tokenized), "--target", str(gemma_base), "--device", "cpu",
                          "--out", str(tmp_path / "feats")], capsys)
    assert rc == 2 and "another vocabulary" in err and not (tmp_path / "feats").exists()

    from fledge.core.target import Target
    from fledge.train.adapt import AdaptConfig, adapt
    from fledge.train.loop import TrainConfig, train
    other = Target(make_tiny("llama"), base_tokenizer(301), "tiny-base", None)
    with pytest.raises(FledgeError, match="tokenized with smollm2-135m#.*another vocabulary"):
        train(TrainConfig(data=str(smollm_tokenized), out=str(tmp_path / "run"), target="tiny-base", max_steps=1,
                          device="cpu"), other)
    shipped = Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m"
    with pytest.raises(FledgeError, match="tokenized with smollm2-135m#.*another vocabulary"):
        adapt(AdaptConfig(drafter=str(shipped), target="tiny-base", data=str(smollm_tokenized),
                          out=str(tmp_path / "adapted")), other)


def test_a_silent_step_shows_its_name_and_a_running_clock(capsys):
    """What a GGUF's tokenizer reading shows while transformers parses it: the step's name,
    redrawn with its elapsed time until the step ends (waits on redraws, asserts no timing)."""
    import time

    from fledge.core.report import ticking

    seen = ""
    with ticking("fledge: reading big.gguf's tokenizer", every_s=0.01):
        deadline = time.monotonic() + 60
        while seen.count("\r") < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
            seen += capsys.readouterr().err
    seen += capsys.readouterr().err
    assert seen.count("fledge: reading big.gguf's tokenizer: 00:0") >= 3  # drawn, then redrawn by the clock
