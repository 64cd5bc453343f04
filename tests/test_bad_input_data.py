"""Bad input to prep, regen and vocab: one line naming the problem, a documented exit code,
never a traceback; a full disk or an unwritable folder leaves the previous output intact."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import traceback

import pytest
import transformers

from fledge import cli
from fledge.core.target import resolve_target

CONV = {"id": "c0", "source": "t", "messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "hello"}]}
TOK = {"id": "s0", "input_ids": [3, 4, 5], "loss_mask": [0, 1, 1]}


def jsonl(path, *rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def no_template_dir(tmp_path_factory):
    """A tokenizer directory whose chat template was removed (a base model's)."""
    d = tmp_path_factory.mktemp("base_tok")
    tok = transformers.AutoTokenizer.from_pretrained(resolve_target("smollm2-135m"))
    tok.chat_template = None
    tok.save_pretrained(d)
    for f in d.glob("chat_template*"):
        f.unlink()
    return str(d)


def _nested(p):
    p.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    return str(p)


def _non_utf8(p):
    p.write_bytes(json.dumps(CONV).encode()[:-2] + b'\xff\xfe"}\n')
    return str(p)


def _in_folder(t):
    (t / "in").mkdir()
    return ["prep", jsonl(t / "in" / "x.jsonl", CONV), "-o", str(t / "in"), "--overwrite"]


REGEN = ["--server", "http://127.0.0.1:9", "--retries", "0"]  # never reached: the input is refused first
ACCEPT = ["--accept-length", "2.5"]  # tune: a measured acceptance, so only the flag under test is wrong
_HOLDERS: list[subprocess.Popen] = []  # processes holding an output's lock, ended after each case
HOLD = """
import sys, time
from fledge.core.files import output_lock
with output_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def _held(path, argv):
    """`argv`, with another process holding the lock of its output `path` (a second writer)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    _HOLDERS.append(p)
    assert p.stdout.readline() == "held\n"
    return argv


@pytest.fixture(autouse=True)
def _end_holders():
    yield
    while _HOLDERS:
        p = _HOLDERS.pop()
        p.kill()
        p.wait()


def _text(p, data=b"my notes\nabout things"):
    p.write_bytes(data)
    return str(p)


def _tok_dir():
    return str(resolve_target("smollm2-135m"))

# (name, argv builder, expected exit code, phrase the message must contain)
CASES = [
    ("prep max-len 0", lambda t: ["prep", jsonl(t / "x.jsonl", CONV), "--max-len", "0"], 2, "--max-len 0"),
    ("prep max-len negative", lambda t: ["prep", jsonl(t / "x.jsonl", CONV), "--max-len", "-3"], 2, "--max-len -3"),
    ("prep limit 0", lambda t: ["prep", jsonl(t / "x.jsonl", CONV), "--limit", "0"], 2, "--limit 0"),
    ("prep non-UTF-8", lambda t: ["prep", _non_utf8(t / "x.jsonl")], 2, "not UTF-8"),
    ("prep deeply nested JSON", lambda t: ["prep", _nested(t / "x.jsonl")], 2, "nested too deeply"),
    ("prep output is the input", lambda t: ["prep", jsonl(t / "x.jsonl", CONV), "-o", str(t / "x.jsonl"),
                                            "--overwrite"], 2, "the output is the input"),
    ("prep output holds the input", _in_folder, 2, "the output contains the input"),
    ("regen missing input", lambda t: ["regen", str(t / "nope.jsonl"), str(t / "r.jsonl"), *REGEN], 2,
     "no such file"),
    ("regen directory input", lambda t: ["regen", str(t), str(t / "r.jsonl"), *REGEN], 2, "is a directory"),
    ("regen directory output", lambda t: ["regen", jsonl(t / "c.jsonl", CONV), str(t), *REGEN], 2,
     "is a directory"),
    ("regen output is the input", lambda t: ["regen", jsonl(t / "c.jsonl", CONV), str(t / "c.jsonl"), *REGEN], 2,
     "the output is the input"),
    ("vocab output is the dataset", lambda t: ["vocab", "build", jsonl(t / "d.json", TOK), "--size", "2",
                                               "--target-vocab", "10", "-o", str(t / "d.safetensors")], 2,
     "the output is the input dataset"),
    ("regen raw ShareGPT", lambda t: ["regen", jsonl(t / "c.jsonl", {"id": "a", "conversations": []}),
                                      str(t / "r.jsonl"), *REGEN], 2, "run `fledge prep`"),
    ("regen tokenized file", lambda t: ["regen", jsonl(t / "c.jsonl", TOK), str(t / "r.jsonl"), *REGEN], 2,
     "tokenized sample"),
    ("regen line without id", lambda t: ["regen", jsonl(t / "c.jsonl", CONV, {"messages": CONV["messages"]}),
                                         str(t / "r.jsonl"), *REGEN], 2, ":2: no 'id'"),
    ("bench concurrency not integers", lambda t: ["bench", "--url", "http://127.0.0.1:9/v1", "--concurrency", "1,a"],
     2, "--concurrency '1,a'"),
    ("regen max-new-tokens 0", lambda t: ["regen", jsonl(t / "c.jsonl", CONV), str(t / "r.jsonl"),
                                          "--max-new-tokens", "0", *REGEN], 2, "--max-new-tokens 0"),
    ("vocab float ids", lambda t: ["vocab", "build", jsonl(t / "d.jsonl", {**TOK, "input_ids": [3.0, 4.5, 5.0]}),
                                   "--size", "2", "--target-vocab", "10", "-o", str(t / "v.safetensors")], 2, "float"),
    ("vocab string ids", lambda t: ["vocab", "build", jsonl(t / "d.jsonl", {**TOK, "input_ids": ["a", "b", "c"]}),
                                    "--size", "2", "--target-vocab", "10", "-o", str(t / "v.safetensors")], 2,
     "lists of integers"),
    ("vocab no trained token", lambda t: ["vocab", "build", jsonl(t / "d.jsonl", {**TOK, "loss_mask": [0, 0, 0]}),
                                          "--size", "2", "--target-vocab", "10", "-o", str(t / "v.safetensors")], 2,
     "no sample has a trained token"),
    ("vocab missing input", lambda t: ["vocab", "build", str(t / "nope.jsonl"), "--size", "2", "--target-vocab",
                                       "10", "-o", str(t / "v.safetensors")], 2, "no such file"),
    ("vocab output is a directory", lambda t: ["vocab", "build", jsonl(t / "d.jsonl", TOK), "--size", "2",
                                               "--target-vocab", "10", "-o", str(t)], 2, "is a directory"),
    ("vocab coverage missing dataset", lambda t: ["vocab", "coverage", str(t / "v.safetensors"),
                                                  str(t / "nope.jsonl")], 2, "no such file"),
    ("regen second writer", lambda t: _held(t / "r.jsonl", ["regen", jsonl(t / "c.jsonl", CONV), str(t / "r.jsonl"),
                                                            *REGEN]), 2, "another fledge run (pid"),
    ("tokenize second writer", lambda t: _held(t / "tok", ["tokenize", jsonl(t / "c.jsonl", CONV), "-o", str(t / "tok"),
                                                           "--tokenizer", _tok_dir(), "--workers", "1"]), 2,
     "another fledge run (pid"),
    ("vocab second writer", lambda t: _held(t / "v.safetensors", ["vocab", "build", jsonl(t / "d.jsonl", TOK), "--size",
                                                                  "2", "--target-vocab", "10", "-o",
                                                                  str(t / "v.safetensors")]), 2, "another fledge run (pid"),
    ("regen onto a text file", lambda t: ["regen", jsonl(t / "c.jsonl", CONV), _text(t / "notes.txt"), *REGEN], 2,
     "not a regen output (line 1 is not a JSON object)"),
    ("regen onto JSONL ending in text", lambda t: ["regen", jsonl(t / "c.jsonl", CONV),
                                                   _text(t / "o.jsonl", b'{"id": "a", "messages": []}\nmy notes'),
                                                   *REGEN], 2, "not a regen output (line 2 is not JSON)"),
    ("prompts onto a text file", lambda t: ["prompts", _text(t / "notes.txt"), "-n", "1"], 2,
     "not a prompts output (line 1 is not a JSON object)"),
    ("bench --json is its --log", lambda t: ["bench", "--log", _text(t / "server.log"), "--json", str(t / "server.log")], 2,
     "the output is the input --log"),
    ("tune --json is its --model config", lambda t: ["tune", "model", "--model", _text(t / "cfg.json", b'{"hidden_size": 8}'),
                                                     "--gpu", "h100", "--json", str(t / "cfg.json")], 2,
     "the output is the input --model"),
    ("tune --tp 0", lambda t: ["tune", "model", "--model", "smollm2-135m", "--gpu", "h100", *ACCEPT, "--tp", "0"], 2,
     "argument --tp: 0: must be an integer >= 1"),
    ("tune negative bandwidth", lambda t: ["tune", "model", "--model", "smollm2-135m", "--gpu", "h100", *ACCEPT, "--hbm-gbs", "-5"], 2,
     "argument --hbm-gbs: -5: must be a finite number > 0"),
    ("tune NaN bandwidth", lambda t: ["tune", "model", "--model", "smollm2-135m", "--gpu", "h100", *ACCEPT, "--hbm-gbs", "nan"], 2,
     "argument --hbm-gbs: nan"),
    ("tune negative context", lambda t: ["tune", "model", "--model", "smollm2-135m", "--gpu", "h100", *ACCEPT, "--context", "-1"], 2,
     "argument --context: -1: must be an integer >= 1"),
    ("tune huge max-depth", lambda t: ["tune", "model", "--model", "smollm2-135m", "--gpu", "h100", *ACCEPT, "--max-depth", "1000000000"],
     2, "argument --max-depth: 1000000000: must be an integer >= 1 and <= 64"),
    ("generate ngram 0", lambda t: ["generate", "--target", "smollm2-135m", "--prompt", "hi", "--ngram", "0"], 2,
     "argument --ngram: 0: must be an integer >= 1"),
    ("generate top-p inf", lambda t: ["generate", "--target", "smollm2-135m", "--prompt", "hi", "--top-p", "inf"], 2,
     "argument --top-p: inf"),
    ("regen timeout NaN", lambda t: ["regen", jsonl(t / "c.jsonl", CONV), str(t / "r.jsonl"), "--server",
                                     "http://127.0.0.1:9", "--timeout", "nan"], 2, "argument --timeout: nan"),
]


def _run(argv, capsys):
    try:
        rc = cli.main(argv)
    except BaseException:  # a traceback (or argparse's SystemExit) is what these cases must not give
        pytest.fail(f"{argv} raised instead of one line:\n{traceback.format_exc()}")
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("name,build,code,phrase", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(name, build, code, phrase, tmp_path, capsys):
    if name == "vocab coverage missing dataset":  # a real vocab, so only the dataset is wrong
        assert cli.main(["vocab", "build", jsonl(tmp_path / "d.jsonl", TOK), "--size", "2", "--target-vocab",
                         "10", "-o", str(tmp_path / "v.safetensors")]) == 0
        capsys.readouterr()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    rc, err = _run(build(tmp_path), capsys)
    lines = [ln for ln in err.splitlines() if ln.startswith("fledge: error:")]
    assert rc == code, err
    assert len(lines) == 1 and phrase in lines[0], err
    assert "Traceback" not in err
    for p, data in before.items():  # a refused command destroys nothing it was given
        assert p.is_file() and p.read_bytes() == data, p


def test_prep_without_chat_template_is_one_line(tmp_path, capsys, no_template_dir):
    rc, err = _run(["prep", jsonl(tmp_path / "x.jsonl", CONV), "-o", str(tmp_path / "o"), "--heldout", "0",
                    "--tokenizer", no_template_dir], capsys)
    assert rc == 2 and "no chat template" in err and "Traceback" not in err


# --------------------------------------------------------------------------- full disk, read-only folder
def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def _erofs(*a, **k):
    raise OSError(errno.EROFS, "Read-only file system")


def _prep(t):
    src = jsonl(t / "x.jsonl", CONV, {**CONV, "id": "c1", "messages": [{"role": "user", "content": "other"}]})
    return ["prep", src, "-o", str(t / "out"), "--heldout", "1", "--overwrite"], t / "out"


def _vocab(t):
    return ["vocab", "build", jsonl(t / "d.jsonl", TOK), "--size", "2", "--target-vocab", "10",
            "-o", str(t / "v.safetensors")], t / "v.safetensors"


@pytest.mark.parametrize("fault", [_enospc, _erofs], ids=["full disk", "read-only"])
@pytest.mark.parametrize("command", [_prep, _vocab], ids=["prep", "vocab"])
def test_unwritable_output_keeps_the_previous_one(command, fault, tmp_path, capsys, monkeypatch):
    argv, out = command(tmp_path)
    assert cli.main(argv) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in [out, *out.parent.rglob("*")] if p.is_file()}
    # a full disk fails at the flush to disk; a read-only folder when the temporary file is made
    if fault is _enospc:
        monkeypatch.setattr("os.fsync", fault)
    else:
        monkeypatch.setattr("tempfile.mkstemp", fault)
        monkeypatch.setattr("tempfile.mkdtemp", fault)
    rc, err = _run(argv, capsys)
    monkeypatch.undo()
    assert rc == 1 and "Traceback" not in err  # a full disk and a read-only file system are runtime failures
    assert str(out) in err and ("No space left" in err or "Read-only" in err), err
    after = {p: p.read_bytes() for p in [out, *out.parent.rglob("*")] if p.is_file()}
    assert after == before  # the previous output intact, no temporary file left behind


def test_regen_unwritable_output_keeps_what_was_written(tmp_path, capsys, monkeypatch):
    from test_regen import _serve

    import fledge.data.regen
    srv, url = _serve(fail_first=0)
    convs = jsonl(tmp_path / "c.jsonl", *({**CONV, "id": f"c{i}"} for i in range(4)))
    out = tmp_path / "r.jsonl"
    assert cli.main(["regen", convs, str(out), "--server", url, "--limit", "2"]) == 0
    capsys.readouterr()
    before = out.read_bytes()
    monkeypatch.setattr("os.fsync", _enospc)
    rc, err = _run(["regen", convs, str(out), "--server", url], capsys)
    assert rc == 1 and str(out) in err and "No space left" in err and "Traceback" not in err
    assert out.read_bytes().startswith(before)
    monkeypatch.undo()

    def read_only(path, mode="r", *a, **k):
        if any(c in mode for c in "aw+"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return open(path, mode, *a, **k)

    monkeypatch.setattr(fledge.data.regen, "open", read_only, raising=False)
    rc, err = _run(["regen", convs, str(out), "--server", url], capsys)
    monkeypatch.undo()
    assert rc == 1 and str(out) in err and "Read-only" in err and "Traceback" not in err
    assert out.read_bytes().startswith(before)
    # Room again: the rerun finishes without duplicates.
    assert cli.main(["regen", convs, str(out), "--server", url]) == 0
    srv.shutdown()
    ids = [json.loads(ln)["id"] for ln in out.read_text().splitlines()]
    assert sorted(ids) == [f"c{i}" for i in range(4)]



def test_regen_disk_full_mid_line_leaves_no_torn_line(tmp_path, capsys, monkeypatch):
    """The disk fills halfway through a record's write: one line naming the output and saying
    how to resume, exit 1, the file exactly as before (no torn line); the rerun completes it."""
    from test_regen import _serve
    srv, url = _serve(fail_first=0)
    convs = jsonl(tmp_path / "c.jsonl", *({**CONV, "id": f"c{i}"} for i in range(4)))
    out = tmp_path / "r.jsonl"
    assert cli.main(["regen", convs, str(out), "--server", url, "--limit", "2"]) == 0
    capsys.readouterr()
    before = out.read_bytes()
    real = os.write

    def half_then_full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}") == str(out):
            real(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)
    monkeypatch.setattr(os, "write", half_then_full)
    rc, err = _run(["regen", convs, str(out), "--server", url], capsys)
    monkeypatch.undo()
    lines = [ln for ln in err.splitlines() if ln.startswith("fledge")]
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert f"{out}: No space left on device" in lines[0] and "rerun the same command to resume" in lines[0], lines
    assert out.read_bytes() == before
    assert cli.main(["regen", convs, str(out), "--server", url]) == 0
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == [f"c{i}" for i in range(4)]


def test_a_dead_writers_lock_is_taken_over(tmp_path):
    """A writer killed with its lock file left behind (naming its dead pid): the next run takes
    the lock, and leaves no lock file when it ends."""
    from fledge.core.files import output_lock
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "held\n"
    lock = tmp_path / ".out.writer.lock"
    assert lock.read_text().strip() == str(p.pid)
    p.kill()
    p.wait()
    assert lock.exists()  # a kill -9 removes nothing
    with output_lock(tmp_path / "out"):
        assert lock.read_text().strip() == str(os.getpid())
    assert not lock.exists()


def test_taking_a_lock_clears_what_a_killed_writer_left(tmp_path):
    """Temporary files of a writer killed mid-write, beside the output and inside a folder output,
    go when the next writer takes the lock; other files stay."""
    from fledge.core.files import output_lock
    out = tmp_path / "feats"
    out.mkdir()
    left = [tmp_path / ".feats.x1.tmp", out / ".shard_00001.safetensors.x2.tmp", out / ".meta.json.x3.tmp"]
    for p in left:
        p.write_bytes(b"half")
    (tmp_path / ".feats.x4.tmp").mkdir()  # an atomic_dir's
    kept = [out / "shard_00000.safetensors", tmp_path / ".other.x5.tmp"]
    for p in kept:
        p.write_bytes(b"whole")
    with output_lock(out):
        assert not any(p.exists() for p in left) and not (tmp_path / ".feats.x4.tmp").exists()
    assert all(p.read_bytes() == b"whole" for p in kept)


@pytest.mark.parametrize("where,name,args,kwargs", [
    ("fledge.core.config", "TrainConfig", ("d", "o"), {"lr": float("inf")}),
    ("fledge.core.config", "TrainConfig", ("d", "o"), {"max_steps": 2.5}),
    ("fledge.engine.sampling", "SamplingParams", (), {"temperature": float("nan")}),
    ("fledge.data.regen", "RegenConfig", (), {"chunk": 0}),
    ("fledge.perf.hwmodel", "hardware", ("h100",), {"host_ms": float("inf")}),
    ("fledge.perf.hwmodel", "hardware", ("h100",), {"tp": 0}),
    ("fledge.perf.serving", "ServerBench", ("http://127.0.0.1:9", ["p"]), {"timeout_s": float("nan")}),
], ids=["train lr inf", "train max_steps float", "sampling temperature NaN", "regen chunk 0", "hardware host inf",
        "hardware tp 0", "bench timeout NaN"])
def test_config_dataclasses_refuse_nonsense_numbers(where, name, args, kwargs):
    """The dataclasses check their own numbers, for callers that do not come through the CLI."""
    import importlib

    from fledge.core.errors import FledgeError
    make = getattr(importlib.import_module(where), name)
    with pytest.raises(FledgeError, match=r"must be (an integer|a finite number)"):
        make(*args, **kwargs)
