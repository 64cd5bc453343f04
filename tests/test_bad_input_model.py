"""Bad input and faults on the model side (train, export, import, generate): one table of cases,
each an exit code and one line without a traceback, and nothing previous lost; plus the faults
that need a process of their own (a hang, kill -9) and the checkpoint swap cut between renames."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import forked
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_bad_input_data import _end_holders, _held  # noqa: F401 (a fixture)
from test_checkpoint import tiny_draft
from test_train import config, curve, tiny_target, write_data

from fledge import cli
from fledge.core.errors import FledgeError
from fledge.core.files import check_no_overlap
from fledge.drafter.checkpoint import export_checkpoint

TRAIN = ("--max-steps", "2", "--batch-size", "2", "--ttt-steps", "2", "--save-every", "1", "--log-every", "1")


# --------------------------------------------------------------------------- shared inputs
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny target dir, a data file, a drafter dir, and a finished 2-step run (checkpoint at step 2)."""
    from test_target import save_tiny_dir
    root = tmp_path_factory.mktemp("base")
    save_tiny_dir(root / "target")
    write_data(root / "data.jsonl", n=16)
    export_checkpoint(tiny_draft()[0], root / "draft")
    assert cli.main(train_argv(root, root / "run")) == 0
    return root


def train_argv(base: Path, out: Path, *extra) -> list[str]:
    return ["train", "--data", str(base / "data.jsonl"), "--out", str(out), "--target", str(base / "target"),
            *TRAIN, *extra]


def copy(base: Path, tmp: Path, name: str) -> Path:
    shutil.copytree(base / name, tmp / name)
    return tmp / name


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def edit_weights(d: Path, fn) -> None:
    t = load_file(d / "model.safetensors")
    fn(t)
    save_file(t, d / "model.safetensors")


def sharded(tmp: Path, shard_name: str) -> Path:
    """A two-shard drafter whose index sends the fc shard to `shard_name`."""
    d = export_checkpoint(tiny_draft()[0], tmp / "sharded", shard_size_mb=0.02)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["fc.weight"] = shard_name
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def read_only(folder: Path, monkeypatch) -> None:
    """Make `folder` unwritable. Root ignores mode bits, so there the temp-file calls every
    fledge write starts with fail as the kernel would fail them."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o555)
    if os.geteuid() != 0:
        return
    for name in ("mkdtemp", "mkstemp"):
        real = getattr(tempfile, name)

        def refuse(*a, _real=real, **kw):
            if Path(kw.get("dir", "")).resolve() == folder.resolve():
                raise PermissionError(errno.EACCES, "Permission denied", str(Path(kw["dir"]) / ".tmp"))
            return _real(*a, **kw)
        monkeypatch.setattr(tempfile, name, refuse)


def full_disk_on(monkeypatch, needle: str) -> None:
    """fsync of a file whose path contains `needle` fails as on a full disk."""
    real = os.fsync

    def fsync(fd):
        if needle in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)


def no_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


class Payload:
    """Unpickling this creates a directory: the mark that a planted state.pt ran code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


# --------------------------------------------------------------------------- the table
def export_nan(b, t, mp):
    d = copy(b, t, "draft")
    edit_weights(d, lambda w: w["fc.weight"].view(-1).__setitem__(3, float("nan")))
    return ["export", str(d), str(t / "out")]


def export_list_config(b, t, mp):
    d = copy(b, t, "draft")
    (d / "config.json").write_text("[1, 2]")
    return ["export", str(d), str(t / "out")]


def export_into_itself(b, t, mp):
    d = copy(b, t, "draft")
    return ["export", str(d), str(d), "--overwrite"]


def export_over_its_run(b, t, mp):
    run = copy(b, t, "run")  # runs/r/draft → runs/r would delete the checkpoint and metrics
    return ["export", str(run / "draft"), str(run), "--overwrite"]


def export_full_disk(b, t, mp):
    d = copy(b, t, "draft")
    export_checkpoint(tiny_draft(seed=3)[0], t / "out")  # the previous export, which must survive
    full_disk_on(mp, ".safetensors")
    return ["export", str(d), str(t / "out"), "--overwrite"]


def export_read_only(b, t, mp):
    d = copy(b, t, "draft")
    read_only(t / "ro", mp)
    return ["export", str(d), str(t / "ro" / "out")]


def export_link_out(b, t, mp):
    d = sharded(t, "up/fc.safetensors")
    (t / "elsewhere").mkdir()
    shutil.copy(sorted(d.glob("model-*.safetensors"))[0], t / "elsewhere" / "fc.safetensors")
    os.symlink(t / "elsewhere", d / "up")  # a link in the checkpoint dir that leads out of it
    return ["export", str(d), str(t / "o")]


def train_resume(corrupt):
    def build(b, t, mp):
        run = copy(b, t, "run")
        corrupt(run / "checkpoint", t)
        return train_argv(b, run)
    return build


def _truncate(ck, t):
    data = (ck / "state.pt").read_bytes()
    (ck / "state.pt").write_bytes(data[: len(data) // 2])


def _plant(ck, t):
    torch.save({"step": 2, "model": Payload(t / "pwned")}, ck / "state.pt")


def _other_step(ck, t):
    state = torch.load(ck / "state.pt", weights_only=True)
    torch.save({**state, "step": 1}, ck / "state.pt")


def train_full_disk(b, t, mp):
    full_disk_on(mp, "state.pt")  # the first checkpoint save
    return train_argv(b, t / "run")


def train_read_only(b, t, mp):
    read_only(t / "run", mp)
    return train_argv(b, t / "run")


def train_nan_target(b, t, mp):
    import transformers
    target = copy(b, t, "target")
    model = transformers.AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(target)
    return ["train", "--data", str(b / "data.jsonl"), "--out", str(t / "run"), "--target", str(target), *TRAIN]


def train_vocab_outside(b, t, mp):
    d = sharded(t, "../evil.safetensors")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["d2t"] = "../evil.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return train_argv(b, t / "run", "--vocab", str(d))


def cuda_missing(argv):
    def build(b, t, mp):
        no_cuda(mp)
        return argv(b, t)
    return build


def float_ids(b, t, mp):
    rows = [json.loads(line) for line in (b / "data.jsonl").read_text().splitlines()]
    rows[3]["input_ids"] = [float(x) + 0.5 for x in rows[3]["input_ids"]]
    (t / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["train", "--data", str(t / "data.jsonl"), "--out", str(t / "run"), "--target", str(b / "target"), *TRAIN]


def remote_code(b, t):
    """A copy of the target whose config names a Python file of its own; importing it would
    leave the mark `pwned`."""
    d = copy(b, t, "target")
    (d / "evil.py").write_text(f"import os\nos.mkdir({str(t / 'pwned')!r})\n")
    cj = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cj, "auto_map": {"AutoConfig": "evil.EvilConfig",
                                                                   "AutoModelForCausalLM": "evil.Evil"}}))
    return d


def messages_json(b, t, mp):
    (t / "m.json").write_text('[{"role": "user", "content": "hi"}]')
    return ["generate", "--target", str(b / "target"), "--messages", str(t / "m.json"), "--json", str(t / "m.json"),
            "--max-new-tokens", "2"]


def features_argv(b: Path, t: Path, *extra) -> list[str]:
    return ["features", "--target", str(b / "target"), "--data", str(b / "data.jsonl"), "--out", str(t / "f"),
            "--dtype", "fp32", *extra]


CASES = {  # name: (argv builder (base, tmp, monkeypatch), exit code, phrase of the one line)
    "export_shard_size_negative": (lambda b, t, mp: ["export", str(copy(b, t, "draft")), str(t / "o"),
                                                     "--shard-size-mb", "-1"], 2, "argument --shard-size-mb: -1"),
    "export_shard_size_nan": (lambda b, t, mp: ["export", str(copy(b, t, "draft")), str(t / "o"),
                                                "--shard-size-mb", "nan"], 2, "argument --shard-size-mb: nan"),
    "export_second_writer": (lambda b, t, mp: _held(t / "o", ["export", str(copy(b, t, "draft")), str(t / "o")]), 2,
                             "another fledge run (pid"),
    "train_second_writer": (lambda b, t, mp: _held(t / "run", train_argv(b, t / "run")), 2, "another fledge run (pid"),
    "adapt_second_writer": (lambda b, t, mp: _held(t / "ad", ["adapt", "--drafter", str(b / "draft"), "--target",
                                                              str(b / "target"), "--data", str(b / "data.jsonl"),
                                                              "--out", str(t / "ad"), "--no-train"]), 2,
                            "another fledge run (pid"),
    "train_time_budget_inf": (lambda b, t, mp: ["train", "--data", str(b / "data.jsonl"), "--out", str(t / "run"),
                                                "--target", str(b / "target"), "--time-budget", "inf"], 2,
                              "--time-budget inf: must be a finite number"),
    "train_weight_decay_nan": (lambda b, t, mp: train_argv(b, t / "run", "--weight-decay", "nan"), 2,
                               "--weight-decay nan: must be a finite number"),
    "train_float_token_ids": (float_ids, 2, "data.jsonl:4: 'input_ids' and 'loss_mask' must hold integers"),
    "target_json_is_its_config": (lambda b, t, mp: ["target", str(copy(b, t, "target")), "--json",
                                                    str(t / "target" / "config.json")], 2,
                                  "the output lies inside the input spec"),
    "generate_json_is_its_messages": (messages_json, 2, "the output is the input --messages"),
    "target_remote_code": (lambda b, t, mp: ["target", str(remote_code(b, t))], 2,
                           "names Python code of its own to run (auto_map: AutoConfig, AutoModelForCausalLM)"),
    "train_remote_code": (lambda b, t, mp: ["train", "--data", str(b / "data.jsonl"), "--out", str(t / "run"),
                                            "--target", str(remote_code(b, t)), *TRAIN], 2,
                          "names Python code of its own to run"),
    "export_nan_weight": (export_nan, 2, "fc.weight contains NaN or inf"),
    "export_config_is_a_list": (export_list_config, 2, "a JSON list, not an object"),
    "export_shard_parent": (lambda b, t, mp: ["export", str(sharded(t, "../x.safetensors")), str(t / "o")], 2,
                            "shard '../x.safetensors' is not a file name inside"),
    "export_shard_absolute": (lambda b, t, mp: ["export", str(sharded(t, str(t / "x.safetensors"))), str(t / "o")], 2,
                              "is not a file name inside"),
    "export_shard_link_out": (export_link_out, 2, "leads outside"),
    "export_out_is_src": (export_into_itself, 2, "the output is the input src"),
    "export_out_holds_src": (export_over_its_run, 2, "the output contains the input src"),
    "import_out_inside_src": (lambda b, t, mp: ["import", str(copy(b, t, "draft")), str(t / "draft" / "sub")], 2,
                              "the output lies inside the input src"),
    "init_draft_over_its_target": (lambda b, t, mp: ["init-draft", str(copy(b, t, "target")), "--target",
                                                     str(t / "target"), "--overwrite"], 2, "the output is the input --target"),
    "train_out_over_its_init": (lambda b, t, mp: train_argv(b, copy(b, t, "run"), "--init", str(t / "run" / "draft")), 2,
                                "the output is the input --init"),
    "export_full_disk": (export_full_disk, 1, "No space left on device"),
    "export_read_only": (export_read_only, 2, "/ro: Permission denied"),
    "train_data_is_a_dir": (lambda b, t, mp: ["train", "--data", str(t), "--out", str(t / "run"), *TRAIN], 2,
                            "expected a tokenized JSONL file"),
    "train_missing_data": (lambda b, t, mp: ["train", "--data", str(t / "nope.jsonl"), "--out", str(t / "run")], 2,
                           "does not exist"),
    "train_resume_state_missing": (train_resume(lambda ck, t: (ck / "state.pt").unlink()), 2,
                                   "cannot resume from step 2: state.pt is missing"),
    "train_resume_state_truncated": (train_resume(_truncate), 2, "cannot resume from step 2: state.pt is truncated, corrupt"),
    "train_resume_state_garbage": (train_resume(lambda ck, t: (ck / "state.pt").write_bytes(b"not a state" * 9)), 2,
                                   "cannot resume from step 2: state.pt is truncated, corrupt"),
    "train_resume_pickle_payload": (train_resume(_plant), 2, "holds objects beyond tensors and plain data (never unpickled"),
    "train_resume_state_of_other_step": (train_resume(_other_step), 2, "not the state of that step (holds step 1)"),
    "train_resume_meta_garbage": (train_resume(lambda ck, t: (ck / "meta.json").write_text("{")), 2,
                                  "meta.json unreadable"),
    "train_resume_meta_bad_step": (train_resume(lambda ck, t: (ck / "meta.json").write_text('{"step": "2", "key": {}}')),
                                   2, "meta.json holds step '2'"),
    "train_resume_meta_missing": (train_resume(lambda ck, t: (ck / "meta.json").unlink()), 2, "meta.json unreadable"),
    "train_full_disk": (train_full_disk, 1, "state.pt: No space left on device"),
    "train_read_only_out": (train_read_only, 2, "/run: Permission denied"),
    "train_nan_loss": (train_nan_target, 2, "NaN or inf at step 1 (the first forward"),
    "train_vocab_index_outside": (train_vocab_outside, 2, "is not a file name inside"),
    "train_device_cuda_without_cuda": (cuda_missing(lambda b, t: train_argv(b, t / "run", "--device", "cuda")), 2,
                                       "no CUDA device; pass --device cpu"),
    "generate_device_cuda_without_cuda": (
        cuda_missing(lambda b, t: ["generate", "--target", str(b / "target"), "--prompt", "hi", "--device", "cuda"]), 2,
        "no CUDA device; pass --device cpu"),
    "generate_device_garbage": (lambda b, t, mp: ["generate", "--target", "x", "--prompt", "hi", "--device", "gpu0"], 2,
                                "--device gpu0: not a device name"),
    "generate_dtype_garbage": (lambda b, t, mp: ["generate", "--target", "x", "--prompt", "hi", "--dtype", "int8"], 2,
                               "--dtype int8: choose one of bfloat16, float16, float32, bf16, fp16, fp32"),
    "features_shard_size_0": (lambda b, t, mp: features_argv(b, t, "--shard-size", "0"), 2, "argument --shard-size: 0"),
    "features_batch_size_0": (lambda b, t, mp: features_argv(b, t, "--batch-size", "0"), 2, "argument --batch-size: 0"),
    "features_max_len_negative": (lambda b, t, mp: features_argv(b, t, "--max-len", "-5"), 2, "argument --max-len: -5"),
    "export_dtype_garbage": (lambda b, t, mp: ["export", str(copy(b, t, "draft")), str(t / "o"), "--dtype", "fp8"], 2,
                             "--dtype fp8: choose one of"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line(case, base, tmp_path, monkeypatch, capsys):
    build, code, phrase = CASES[case]
    argv = build(base, tmp_path, monkeypatch)
    before = {p: snapshot(p) for p in tmp_path.iterdir() if p.is_dir() and os.access(p, os.W_OK)}
    monkeypatch.delenv("FLEDGE_DEBUG", raising=False)
    try:
        rc = cli.main(argv)
    finally:
        monkeypatch.undo()  # the fault ends with the command: what follows reads the disk as it is
        for p in tmp_path.rglob("*"):
            if p.is_dir():
                p.chmod(0o755)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("fledge")]  # not HF's or tqdm's bars
    assert rc == code and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("fledge: error: ") and phrase in lines[0], lines
    for p, files in before.items():  # every input and previous output is as it was, no temp dir left
        assert snapshot(p) == files, p
        assert not [q for q in p.parent.glob(f".{p.name}.*")], p
    assert not (tmp_path / "pwned").exists()  # the planted pickle did not run
    if case == "train_full_disk":
        assert not (tmp_path / "run" / "checkpoint").exists() and not list((tmp_path / "run").glob(".checkpoint*"))


def test_debug_shows_the_traceback(base, tmp_path, monkeypatch):
    argv = export_list_config(base, tmp_path, monkeypatch)
    with pytest.raises(FledgeError):
        cli.main(["--debug", *argv])
    monkeypatch.setenv("FLEDGE_DEBUG", "1")
    with pytest.raises(FledgeError):
        cli.main(argv)


def test_full_disk_keeps_the_last_checkpoint(base, tmp_path, monkeypatch, capsys):
    """ENOSPC at the step-2 save: exit 1, and the step-1 checkpoint is still whole and resumable."""
    real = os.fsync

    def fsync(fd):
        if "state.pt" in os.readlink(f"/proc/self/fd/{fd}") and (tmp_path / "run" / "checkpoint").exists():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    assert cli.main(train_argv(base, tmp_path / "run")) == 1
    assert "No space left on device" in capsys.readouterr().err
    meta = json.loads((tmp_path / "run" / "checkpoint" / "meta.json").read_text())
    assert meta["step"] == 1 and not list((tmp_path / "run").glob(".checkpoint*"))
    monkeypatch.undo()
    assert cli.main(train_argv(base, tmp_path / "run")) == 0
    assert curve(tmp_path / "run") == curve(base / "run")


def test_import_arguments_have_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["import", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "drafter dir: eagle3" in out and "output dir, fledge's eagle3 layout" in out
    assert "replace an existing output dir (default: refuse)" in out


def test_overlap_check_sees_through_spellings(tmp_path):
    (tmp_path / "r" / "draft").mkdir(parents=True)
    os.symlink(tmp_path / "r", tmp_path / "link")
    for out, src in (("r", "r/draft"), ("link", "r/draft"), ("r/draft/../draft", "r/draft"), ("r/draft/x", "link")):
        with pytest.raises(FledgeError, match="write it elsewhere"):
            check_no_overlap(tmp_path / out, {"src": tmp_path / src})
    check_no_overlap(tmp_path / "r" / "draft2", {"src": tmp_path / "r" / "draft", "--target": None})


# --------------------------------------------------------------------------- the checkpoint swap
class Killed(BaseException):
    """Stands for a kill -9: nothing after it runs in the process."""


def test_kill_between_the_swap_renames_resumes_from_the_old_checkpoint(tmp_path, monkeypatch):
    """Cut after `checkpoint` → `.checkpoint.old` and before the new one takes its name: the
    rerun resumes from the old checkpoint (step 2, not 0) and ends on the uninterrupted curve."""
    import fledge.train.loop as ft
    write_data(tmp_path / "data.jsonl", n=24)
    kw = dict(max_steps=4, save_every=2)
    ft.train(config(tmp_path, "ref", **kw), tiny_target())
    ck = tmp_path / "cut" / "checkpoint"
    real = os.replace

    def replace(src, dst):
        if Path(dst) == ck and (tmp_path / "cut" / ".checkpoint.old").exists():
            raise Killed
        return real(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Killed):
        ft.train(config(tmp_path, "cut", **kw), tiny_target())
    monkeypatch.undo()
    assert not ck.exists() and json.loads((tmp_path / "cut" / ".checkpoint.old" / "meta.json").read_text())["step"] == 2
    (tmp_path / "cut" / ".checkpoint.killed.tmp").mkdir()  # as a kill in the middle of a save leaves
    steps = []
    real_step = ft.train_step
    monkeypatch.setattr(ft, "train_step", lambda run, step: (steps.append(step), real_step(run, step))[1])
    ft.train(config(tmp_path, "cut", **kw), tiny_target())
    assert steps == [2, 3] and curve(tmp_path / "cut") == curve(tmp_path / "ref")
    assert not [p.name for p in (tmp_path / "cut").glob(".checkpoint*")]


def test_nan_loss_later_stops_at_that_step_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    import fledge.train.loop as ft
    write_data(tmp_path / "data.jsonl", n=24)
    real_step = ft.train_step

    def step(run, s):
        stats, n = real_step(run, s)
        return (stats * float("nan") if s == 2 else stats), n
    monkeypatch.setattr(ft, "train_step", step)
    with pytest.raises(FledgeError, match=r"NaN or inf at step 3: nothing of it was saved"):
        ft.train(config(tmp_path, "run", max_steps=5, save_every=2), tiny_target())
    assert json.loads((tmp_path / "run" / "checkpoint" / "meta.json").read_text())["step"] == 2


# --------------------------------------------------------------------------- own processes
def child_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "FLEDGE_DEBUG": "0"}


@pytest.mark.slow  # two CLI runs, side by side
def test_export_of_a_broken_drafter_exits(tmp_path):
    """A NaN weight and a config that disagrees with the weights' shapes: each export, a process
    of its own, ends by itself with exit 2 and one line, well inside the timeout."""
    nan = export_checkpoint(tiny_draft()[0], tmp_path / "nan")
    edit_weights(nan, lambda w: w["fc.weight"].view(-1).__setitem__(0, float("inf")))
    shape = export_checkpoint(tiny_draft()[0], tmp_path / "shape")
    cj = json.loads((shape / "config.json").read_text())
    (shape / "config.json").write_text(json.dumps({**cj, "intermediate_size": 96}))
    logs = {d: tmp_path / f"{d.name}.log" for d in (nan, shape)}
    procs = [forked.fledge(["export", d, tmp_path / f"out_{d.name}"], env=child_env(), log=logs[d]) for d in logs]
    for p, d, phrase in zip(procs, logs, ("contains NaN or inf", "but config.json implies")):
        rc, err = forked.wait(p, timeout=180), logs[d].read_text()
        assert rc == 2 and "Traceback" not in err and phrase in err, err
    assert not list(tmp_path.glob("out_*")) and not list(tmp_path.glob(".out_*"))


@pytest.mark.slow  # three CLI trainings on a tiny target
def test_kill9_of_the_cli_then_rerun_gives_the_same_curve(base, tmp_path):
    """`fledge train` (forked, see tests/forked.py) killed with SIGKILL once a checkpoint exists,
    then rerun: loss curve and weights equal an uninterrupted run's, bit for bit."""
    write_data(tmp_path / "data.jsonl", n=64, lo=20, hi=40)

    def run(out):
        return forked.fledge(["train", "--data", tmp_path / "data.jsonl", "--out", tmp_path / out, "--target",
                              base / "target", "--max-steps", "12", "--batch-size", "4", "--ttt-steps", "3",
                              "--save-every", "2", "--log-every", "1", "--eval-every", "1000", "--lr", "3e-3"],
                             env=child_env())
    ref, cut = run("ref"), run("cut")
    meta = tmp_path / "cut" / "checkpoint" / "meta.json"
    while cut.is_alive() and not (meta.exists() and json.loads(meta.read_text())["step"] >= 4):
        time.sleep(0.01)
    os.kill(cut.pid, signal.SIGKILL)
    assert forked.wait(cut) == -signal.SIGKILL and forked.wait(ref) == 0
    assert len(curve(tmp_path / "cut")) < 12
    assert forked.wait(run("cut")) == 0
    a, b = curve(tmp_path / "ref"), curve(tmp_path / "cut")
    print(f"kill -9 at step >= 4 of 12: max |dloss| = {max(abs(x - y) for x, y in zip(a, b)):.3g} over {len(a)} steps")
    assert len(a) == len(b) == 12 and a == b
    wa, wb = (load_file(tmp_path / r / "draft" / "model.safetensors") for r in ("ref", "cut"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_doctor_names_a_config_size_that_is_a_string(base, tmp_path, capsys):
    d = copy(base, tmp_path, "draft")
    cj = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cj, "intermediate_size": str(cj["intermediate_size"])}))
    assert cli.main(["doctor", str(d)]) == 2
    out = capsys.readouterr().out
    assert f"intermediate_size '{cj['intermediate_size']}': must be a positive integer" in out, out


def test_remote_code_is_refused_even_with_yes_on_stdin(base, tmp_path, monkeypatch):
    """transformers' own trust prompt would read this "y"; fledge asks nothing and refuses.
    `fledge --trust-remote-code` (FLEDGE_TRUST_REMOTE_CODE=1) lifts the refusal."""
    import io

    from fledge.core.target import check_remote_code
    d = remote_code(base, tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 4))
    monkeypatch.setenv("FLEDGE_TRUST_REMOTE_CODE", "0")
    assert cli.main(["train", "--data", str(base / "data.jsonl"), "--out", str(tmp_path / "run"), "--target", str(d),
                     *TRAIN]) == 2
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "run").exists()
    monkeypatch.setenv("FLEDGE_TRUST_REMOTE_CODE", "1")
    check_remote_code(d)  # allowed: no error
