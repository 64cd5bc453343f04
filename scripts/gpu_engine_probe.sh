#!/usr/bin/env bash
# Engine speed probes that need no model download (SmolLM2-135M's shapes, random weights): what
# a speculative round costs, which kernels its propose and verify run, how long the host keeps
# the GPU waiting between rounds, and where a prefill's time goes. Earlier sessions' parts
# (few-rows kernels, attention, decode profiles, batched AR) are in git history. Also a training
# step's split (bench/profile_train.py). One GPU call, ~3 minutes:
#   bash scripts/gpu_engine_probe.sh            (results in $OUT, default /tmp/probe_out)
# Every part runs even if one before it fails; the script exits 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/probe_out}
mkdir -p "$OUT"
failed=()
part() {  # part NAME CMD...: run, log to $OUT/NAME.log, remember a failure
    local name=$1; shift
    echo "== $name"
    "$@" 2>&1 | tee "$OUT/$name.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || failed+=("$name")
}
# Where a prefill's time goes, eager against its resident graph (engine.resident), each fused
# round's host gap, the propose and verify kernels, and (session 10) the oracle chain 7's round
# and whole request against AR's, prefill included: the engine's ceiling without a download.
trees=(--tree 7,1,8 --tree 5,4,16)
part round python3 bench/profile_round.py --compile --kernels "${trees[@]}" --out "$OUT/profile_round.json"
# Where a training step's time goes (features / TTT forward+backward / optimizer, kernels by
# kind), at the headline run's batch and the data's mean length; with session 9's step first.
part train_step python3 bench/profile_train.py --random --compare --out "$OUT/profile_train.json"
# Batched AR on random weights, prefix kernel against SDPA over spans (decode tok/s at 1,024
# rows: 249.8K in session 5, 173.1K in session 10, 215.4K with attention.py's cached-only loop).
part batched python3 bench/profile_batched.py --batch-sizes 256,1024 --stream 2048 --out "$OUT/profile_batched.json"
(( ${#failed[@]} == 0 )) || { echo "failed: ${failed[*]}"; exit 1; }
