"""`fledge prompts`: the user turn opens where the template puts the user's text; what is kept
is exactly the finished, first-seen samples of each round (checked against the engine's own
samples, recomputed round by round); a torn or cut-short output resumes to the bytes of an
uninterrupted run; a target that repeats itself stops short and says so."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers
from conftest import make_tiny

from fledge import cli
from fledge.core.config import RegenConfig
from fledge.core.errors import FledgeError
from fledge.core.files import read_jsonl
from fledge.core.target import encode_chat, resolve_target, user_turn_prefix
from fledge.data.prompts import SOURCE, prompt_key, write_prompts
from fledge.data.regen import Answer, EngineBackend, answer_seed


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(resolve_target("smollm2-135m"))


@pytest.fixture(scope="module")
def chatty(tok):
    """A tiny random target whose turns end often: one token in seven ends a turn, so that
    prompts of a few tokens finish and others run to --max-new-tokens."""
    model = make_tiny("llama", seed=3, vocab_size=len(tok))
    model.generation_config.eos_token_id = list(range(2, len(tok), 7))
    return SimpleNamespace(model=model, tokenizer=tok, name="chatty")


def _backend(target, temperature=1.0, max_new_tokens=6):
    cfg = RegenConfig(max_new_tokens=max_new_tokens, temperature=temperature, max_len=256, batch_size=4)
    return EngineBackend(target, cfg, device="cpu", dtype=torch.float32)


def test_user_turn_prefix_is_where_the_users_text_begins(tok):
    prefix = user_turn_prefix(tok)
    for text in ("Hello there", "Write a poem.\nTwo lines."):
        whole = encode_chat(tok, [{"role": "user", "content": text}], add_generation_prompt=False)
        assert whole[:len(prefix)] == prefix
        assert tok.decode(whole[len(prefix):]).startswith(text)
    assert tok.decode(prefix).endswith("<|im_start|>user\n")
    bare = transformers.AutoTokenizer.from_pretrained(resolve_target("smollm2-135m"))
    bare.chat_template = None
    with pytest.raises(FledgeError, match="no chat template"):
        user_turn_prefix(bare)


def test_kept_prompts_are_the_finished_first_seen_samples(tmp_path, chatty):
    backend = _backend(chatty)
    counts = write_prompts(backend, tmp_path / "p.jsonl", n=20, chunk=8, seed=4)
    rows = [r for _, r in read_jsonl(tmp_path / "p.jsonl")]
    # Brute force: every round's samples again, filtered by hand.
    prefix, seen, want, tally = user_turn_prefix(chatty.tokenizer), set(), [], {"unfinished": 0, "dup": 0, "empty": 0}
    for r in range(counts["rounds"]):
        for k, g in enumerate(backend.complete([prefix] * 8, answer_seed(4, SOURCE, r))):
            if len(want) == 20:
                break
            if not g or g[-1] not in backend.eos:
                tally["unfinished"] += 1
                continue
            text = chatty.tokenizer.decode(g[:-1])
            key = " ".join(text.split()).lower()
            if not key:
                tally["empty"] += 1
            elif key in seen:
                tally["dup"] += 1
            else:
                seen.add(key)
                want.append({"id": f"self-{r}-{k}", "source": "self", "messages": [{"role": "user", "content": text}]})
    assert rows == want and counts["kept"] == counts["written"] == 20
    assert (counts["unfinished"], counts["duplicate"], counts["empty"]) == (tally["unfinished"], tally["dup"], tally["empty"])
    assert counts["unfinished"] > 0  # the filter was exercised
    assert json.loads((tmp_path / "p.summary.json").read_text())["kept"] == 20


def test_torn_or_short_output_resumes_to_an_uninterrupted_run(tmp_path, chatty):
    backend = _backend(chatty)
    ref = tmp_path / "ref.jsonl"
    write_prompts(backend, ref, n=20, chunk=8, seed=1)
    lines = ref.read_bytes().splitlines(keepends=True)
    for keep in (0, 3, 9, 19):
        out = tmp_path / f"cut{keep}.jsonl"
        out.write_bytes(b"".join(lines[:keep]) + lines[keep][:17])  # a torn last line
        counts = write_prompts(backend, out, n=20, chunk=8, seed=1)
        assert out.read_bytes() == ref.read_bytes(), keep
        assert counts["written"] == 20 - keep
    # Asking for more continues the same file where the shorter run stopped.
    more = tmp_path / "more.jsonl"
    shutil.copy(ref, more)
    write_prompts(backend, more, n=30, chunk=8, seed=1)
    longer = tmp_path / "longer.jsonl"
    write_prompts(backend, longer, n=30, chunk=8, seed=1)
    assert more.read_bytes() == longer.read_bytes()


class _Echo:
    """A target that writes the same finished prompt on every row."""

    def __init__(self, tok):
        self.tok = tok

    def complete(self, prompts, seed, progress=lambda n: None):
        return [self.tok("Same question?")["input_ids"] + [2] for _ in prompts]

    def text(self, tokens):
        return Answer(self.tok.decode(tokens[:-1]), "stop")


def test_a_target_that_repeats_itself_stops_short(tmp_path, tok):
    counts = write_prompts(_Echo(tok), tmp_path / "p.jsonl", n=5, chunk=6)
    # round 0 keeps its first row and counts the other five as duplicates; round 1 adds nothing
    assert (counts["kept"], counts["duplicate"], counts["rounds"]) == (1, 11, 2)
    assert prompt_key("  Tell  me\nMORE ") == prompt_key("tell me more")


def test_bad_outputs_are_refused_naming_the_file(tmp_path, chatty, capsys):
    backend = _backend(chatty)
    other = tmp_path / "regen.jsonl"
    other.write_text(json.dumps({"id": "c1", "source": "sharegpt", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(FledgeError, match="regen.jsonl.*not a `fledge prompts` output"):
        write_prompts(backend, other, n=2, chunk=4)
    with pytest.raises(FledgeError, match="is a directory"):
        write_prompts(backend, tmp_path, n=2, chunk=4)
    assert cli.main(["prompts", str(tmp_path / "x.jsonl"), "-n", "3", "--temperature", "0"]) == 2
    assert "--temperature 0" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_cli_says_when_it_stops_short(tmp_path, tok, capsys):
    """A target that never ends a user turn within --max-new-tokens: nothing is kept, the
    command says so and exits 1."""
    d = tmp_path / "t"
    make_tiny("llama", seed=3, vocab_size=len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    out = tmp_path / "p.jsonl"
    rc = cli.main(["prompts", str(out), "-n", "3", "--target", str(d), "--max-new-tokens", "2", "--chunk", "4"])
    assert rc == 1
    assert "only 0 distinct finished prompts of 3" in capsys.readouterr().err
    assert json.loads(out.with_suffix(".summary.json").read_text())["unfinished"] == 4
    assert not out.exists()  # nothing kept: no output file left behind
