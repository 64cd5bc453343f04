"""The resume state of a run (the draft, optimizer, schedule and RNG at a step), saved atomically and
read back exactly (it is not the drafter checkpoint that `export` writes), and the pause: SIGINT
or SIGTERM stops a run after its current optimizer step with its resume state saved (exit 130); the
same command resumes it exactly, as it resumes one killed outright from its last save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import random
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from fledge.core.errors import FledgeError
from fledge.core.files import atomic_dir, settle_dir, write_file
from fledge.train.budget import EXIT_BUDGET
from fledge.train.features import features_meta
from fledge.train.run import Run

# Fields that change nothing about the numbers, so a resume may differ in them (a resumed run
# keeps the step count its checkpoint records, so a new time budget is only a new deadline).
RESUME_FREE = {"out", "log_every", "eval_every", "save_every", "device", "time_budget"}



# --------------------------------------------------------------------------- checkpoints
def resume_key(run: Run) -> dict:
    """What must match for a checkpoint to continue this run exactly."""
    keep = {k: v for k, v in dataclasses.asdict(run.cfg).items() if k not in RESUME_FREE}
    return json.loads(json.dumps({**keep, "aux_layers": list(run.aux_ids), "world": run.world,
                                  "data_sha": features_meta("", run.cfg.data, run.cfg.max_len)["data_sha"]}))


def full_state(run: Run):
    """Full (unsharded) model and optimizer state dicts on the CPU; a collective under FSDP2."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    return get_state_dict(run.ttt, run.opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_checkpoint(run: Run, step: int, key: dict) -> None:
    model_sd, optim_sd = full_state(run)
    if run.rank == 0:
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
               "cuda": torch.cuda.get_rng_state_all() if run.device.type == "cuda" else None}
        buf = io.BytesIO()  # torch's own writer names no file when the disk fills: write the bytes ourselves
        torch.save({"model": model_sd, "optim": optim_sd, "sched": run.sched.state_dict(), "step": step,
                    "rng": rng}, buf)
        with atomic_dir(Path(run.cfg.out) / "checkpoint", overwrite=True) as tmp:
            write_file(tmp / "state.pt", buf.getvalue())
            meta = {"step": step, "total_steps": run.total_steps, "key": key}
            write_file(tmp / "meta.json", json.dumps(meta, indent=1).encode())
    if dist.is_initialized():
        dist.barrier()


def _refuse_resume(ck: Path, step, why: str) -> FledgeError:
    at = f"from step {step}" if step is not None else "(step unknown)"
    return FledgeError(f"{ck}: cannot resume {at}: {why}; remove {ck} to start again from step 0, or use a new --out")


def read_resume_meta(ck: Path) -> tuple[int, dict, int | None]:
    """(step, resume key, the run's step count) from `<ck>/meta.json`; FledgeError if it is
    missing or malformed. The step count is None where meta.json records none."""
    try:
        meta = json.loads((ck / "meta.json").read_text())
        step, key, total = meta["step"], meta["key"], meta.get("total_steps")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = e.strerror if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        raise _refuse_resume(ck, None, f"meta.json unreadable ({why})") from None
    if not (isinstance(step, int) and step >= 0 and isinstance(key, dict)):
        raise _refuse_resume(ck, None, f"meta.json holds step {step!r} and key of type {type(key).__name__}")
    if total is not None and not (isinstance(total, int) and total >= max(step, 1)):
        raise _refuse_resume(ck, step, f"meta.json holds total_steps {total!r}")
    return step, key, total


def read_resume_state(ck: Path, step: int) -> dict:
    """`<ck>/state.pt` read with weights_only=True: tensors and plain containers only, so a
    planted pickle cannot run code. FledgeError naming the step if it is missing, truncated,
    foreign or of another step than meta.json says."""
    try:
        state = torch.load(ck / "state.pt", map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise _refuse_resume(ck, step, "state.pt is missing") from None
    except Exception:  # truncated zip, garbage, a refused object: torch raises assorted types
        raise _refuse_resume(ck, step, "state.pt is truncated, corrupt, or holds objects beyond tensors and plain "
                                       "data (never unpickled: they could run code)") from None
    keys = {"model", "optim", "sched", "step", "rng"}
    if not (isinstance(state, dict) and keys <= state.keys()) or state["step"] != step:
        got = state.get("step") if isinstance(state, dict) else None
        raise _refuse_resume(ck, step, f"state.pt is not the state of that step (holds step {got})")
    return state


def checkpoint_meta(run: Run, key: dict) -> tuple[int, int | None] | None:
    """(step, the run's step count or None) of `<out>/checkpoint`, None if there is none;
    FledgeError for a checkpoint of another config."""
    ck = settle_dir(Path(run.cfg.out) / "checkpoint")
    if not ck.exists():
        return None
    step, old, total = read_resume_meta(ck)
    if old != key:
        diff = sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k))
        raise FledgeError(f"{ck}: checkpoint of another config ({', '.join(diff)} differ); use a new --out")
    return step, total


def load_checkpoint_state(run: Run, step: int) -> None:
    """Restore weights, optimizer, schedule and RNG from `<out>/checkpoint` (at `step`, as
    `checkpoint_meta` read it). The data position is the step itself (see epoch_batches)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    ck = Path(run.cfg.out) / "checkpoint"
    state = read_resume_state(ck, step)
    set_state_dict(run.ttt, run.opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(full_state_dict=True))
    run.sched.load_state_dict(state["sched"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if state["rng"]["cuda"] is not None and run.device.type == "cuda":
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])


class Paused(Exception):
    """Training stopped between optimizer steps by SIGINT/SIGTERM (`exit_code` 130) or by its
    time budget (EXIT_BUDGET), its checkpoint saved: the same command resumes it exactly."""

    def __init__(self, step: int, total: int, checkpoint: Path, budget: float | None = None):
        why = f"the time budget of {budget:g} s ran out" if budget is not None else "paused"
        super().__init__(f"{why} at step {step} of {total}; {checkpoint} holds the run: rerun the same command to "
                         "resume")
        self.exit_code = 130 if budget is None else EXIT_BUDGET


@contextlib.contextmanager
def pause_on_signal():
    """Yields a flag (a one-element list) that the first SIGINT or SIGTERM sets; a second one
    interrupts as it normally would. So a run cut by `timeout -s INT` (a job scheduler's time
    limit) or by Ctrl-C loses nothing past its last optimizer step. Outside the main thread, where no
    handler can be installed, the flag never rises."""
    flag, old = [False], {}

    def handler(signum, frame):
        if flag[0]:
            raise KeyboardInterrupt
        flag[0] = True

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread
        pass
    try:
        yield flag
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
