"""The doctor's live probe: thresholds, the coverage bound against brute force, and a real run."""

import subprocess
import sys

import pytest
import torch

from fledge.doctor.checks import FAIL, PASS, WARN
from fledge.doctor.probe import accept_check, coverage_check


@pytest.mark.parametrize("accepted,steps,status", [(0, 10, FAIL), (5, 10, WARN), (15, 10, PASS)])
def test_accept_thresholds(accepted, steps, status):
    # accept length = (accepted + steps) / steps: 1.0, 1.5, 2.5
    assert accept_check(accepted, steps, [0.5], 1, 8, 3).status == status


def test_coverage_is_the_share_inside_the_draft_vocab():
    g = torch.Generator().manual_seed(0)
    t2d = torch.rand(500, generator=g) < 0.7
    tokens = torch.randint(0, 500, (1000,), generator=g).tolist()
    share = sum(bool(t2d[t]) for t in tokens) / len(tokens)
    c = coverage_check(tokens, t2d)
    assert f"{share:.3f} of 1000" in c.why and c.status == (PASS if share >= 0.9 else WARN)
    assert coverage_check(tokens, torch.ones(500, dtype=torch.bool)).status == PASS


def test_probe_needs_a_target(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fledge.cli", "doctor", str(tmp_path), "--probe", "2"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == "fledge: error: --probe needs --target: the probe runs the drafter against its target"


@pytest.mark.slow
def test_probe_on_smollm2_flags_a_random_drafter(tmp_path):
    from fledge.core.config import DraftConfig
    from fledge.core.target import eos_ids, load_target
    from fledge.doctor.probe import probe_checks
    from fledge.drafter.checkpoint import export_checkpoint
    from fledge.drafter.eagle3 import Eagle3Draft
    from fledge.engine.decode import generate_ar
    from fledge.engine.hf import build_engine_target
    from fledge.engine.sampling import SamplingParams
    from fledge.perf.bench import load_prompts

    t = load_target("smollm2-135m")
    cfg = DraftConfig.from_target(t.model.config, draft_vocab_size=4096)
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(cfg, t.model, torch.randperm(cfg.vocab_size)[:4096].sort().values)
    out = export_checkpoint(draft, tmp_path / "d")
    checks = {c.name: c for c in probe_checks(out, "smollm2-135m", n=2, max_new_tokens=16, num_steps=3, device="cpu")}
    assert checks["probe.accept"].status == FAIL  # a random drafter accepts (almost) nothing

    # The coverage bound is the share of the target's own greedy tokens inside the draft vocab.
    engine = build_engine_target(t.model, torch.float32, "cpu")
    tokens = []
    for p in load_prompts("mtbench", 2, t.tokenizer):
        tokens += generate_ar(engine, [p], SamplingParams(max_new_tokens=16), eos_ids(t.tokenizer, t.model.generation_config))[0][0]
    share = sum(bool(draft.t2d[x]) for x in tokens) / len(tokens)
    assert f"{share:.3f} of {len(tokens)} generated" in checks["probe.coverage"].why
