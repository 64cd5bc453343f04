"""kill -9 at five points of a `fledge features` run (the target in-process), the same command
run again after each: nothing torn, lost or twice, and no process of a killed run left."""

from __future__ import annotations

import os

import forked
import pytest
from test_target import save_tiny_dir
from test_train import write_data

from fledge import cli


@pytest.mark.slow  # six CLI runs, each loading a tiny target
def test_features_killed_at_five_points_then_rerun_equals_an_uninterrupted_run(tmp_path):
    """Killed once meta.json is written, at the first shard, a quarter, half and all but one of
    the 48 shards: once a killed run is reaped no process of it is alive, and after the reruns the
    directory holds the same files with the same bytes as a run never killed (no temporary file
    left, no shard torn, missing or written twice)."""
    save_tiny_dir(tmp_path / "target")
    data = write_data(tmp_path / "data.jsonl", n=96)
    args = ["features", "--target", str(tmp_path / "target"), "--data", data, "--dtype", "fp32",
            "--shard-size", "2", "--batch-size", "1", "--device", "cpu"]
    out = tmp_path / "killed"
    argv = [*args, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def shards() -> int:
        return len(list(out.glob("shard_*.safetensors")))
    points = [lambda: (out / "meta.json").exists(), lambda: shards() >= 1, lambda: shards() >= 12,
              lambda: shards() >= 24, lambda: shards() >= 47]
    # the target runs in-process: nothing of the run may outlive it even for the 2 s allowed
    assert forked.kill_at(argv, env, points) >= 1
    assert forked.wait(forked.fledge(argv, env=env)) == 0
    assert cli.main([*args, "--out", str(tmp_path / "whole")]) == 0
    whole = {p.name: p.read_bytes() for p in (tmp_path / "whole").iterdir()}
    killed = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(killed) == sorted(whole) and len([n for n in whole if n.startswith("shard_")]) == 48
    assert killed == whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "killed", "target", "whole"]  # no lock left
