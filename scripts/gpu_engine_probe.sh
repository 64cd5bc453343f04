#!/usr/bin/env bash
# Engine speed probes that need no model download (SmolLM2-135M's shapes, random weights):
# what a speculative round costs with the drafter eager and compiled, where a compiled decode
# step's time goes (default and max-autotune compile modes), and which decode attention reads
# the KV cache fastest at regeneration batch sizes. One GPU call, ~5 minutes:
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
part round python3 bench/profile_round.py --compile --out "$OUT/profile_round.json"
part decode_compiled python3 bench/profile_decode.py --random --compile --shapes 1x512,256x1024 \
    --out "$OUT/profile_decode_compiled.json"
part attn python3 bench/attn_decode.py --shapes 256x2048,1024x512,1024x1024 --out "$OUT/attn_decode.json"
part decode_autotune python3 bench/profile_decode.py --random --compile --mode max-autotune-no-cudagraphs \
    --shapes 1x512 --out "$OUT/profile_decode_autotune.json"
(( ${#failed[@]} == 0 )) || { echo "failed: ${failed[*]}"; exit 1; }
