#!/usr/bin/env bash
# Engine speed probes that need no model download (SmolLM2-135M's shapes, random weights): what
# a speculative round costs and which kernels its propose and verify run, with and without the
# few-rows o_proj, each verify matmul alone, and where a prefill's time goes. Earlier sessions'
# parts (attention, decode profiles, batched AR) are in git history. One GPU call, ~3 minutes:
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
# Session 7: o_proj through engine.few_rows for verify forwards against the same call's
# cuBLAS verify, each verify matmul alone, and where a prefill's time goes (--kernels).
trees=(--tree 7,1,8 --tree 5,4,16)
part round python3 bench/profile_round.py --compile --kernels "${trees[@]}" --out "$OUT/profile_round.json"
part round_few_rows python3 bench/profile_round.py --compile --kernels --few-rows 16 "${trees[@]}" \
    --out "$OUT/profile_round_few_rows.json"
part micro python3 bench/few_rows_micro.py --out "$OUT/few_rows_micro.json"
(( ${#failed[@]} == 0 )) || { echo "failed: ${failed[*]}"; exit 1; }
