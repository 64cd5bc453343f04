#!/usr/bin/env bash
# Engine speed probes that need no model download (SmolLM2-135M's shapes, random weights):
# which attention reads the KV cache fastest (batch 1 to regeneration sizes, decode and
# verify), where a compiled decode step's time goes, what a speculative round costs and which
# kernels its propose and verify run, and batched AR end to end — each with the prefix kernel
# and without it, in the same call. One GPU call, ~6 minutes:
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
part attn python3 bench/attn_decode.py --out "$OUT/attn_decode.json"
part decode_prefix python3 bench/profile_decode.py --random --compile --shapes 1x512,256x1024 \
    --out "$OUT/profile_decode_prefix.json"
part decode_spans python3 bench/profile_decode.py --random --compile --no-prefix-kernel --shapes 1x512,256x1024 \
    --out "$OUT/profile_decode_spans.json"
part round python3 bench/profile_round.py --compile --kernels --out "$OUT/profile_round_fast_topk.json"
part round_prefill_buckets python3 bench/profile_round.py --compile --prefill-buckets --tree 5,4,16 \
    --out "$OUT/profile_round_prefill_buckets.json"
part round_torch_topk python3 bench/profile_round.py --compile --kernels --torch-topk --out "$OUT/profile_round.json"
part round_spans python3 bench/profile_round.py --compile --no-prefix-kernel --tree 7,1,8 --tree 5,4,16 \
    --out "$OUT/profile_round_spans.json"
part batched python3 bench/profile_batched.py --out "$OUT/profile_batched.json"
(( ${#failed[@]} == 0 )) || { echo "failed: ${failed[*]}"; exit 1; }
