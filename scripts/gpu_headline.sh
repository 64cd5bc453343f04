#!/usr/bin/env bash
# The headline run: an EAGLE-3 drafter for SmolLM2-135M-Instruct on one offline H200, with its
# figures. Stages are resumable and idempotent; state lives in $WORK (/tmp, kept between
# back-to-back calls on the same warm machine); small results are copied to $OUT.
#
#   here (CPU):  bash scripts/gpu_headline.sh prepare
#                (runs gpu_stage_gguf.sh prepare first if .gguf/part.* are missing)
#   GPU call 1:  bash scripts/gpu_stage_gguf.sh receive aa && bash scripts/gpu_headline.sh receive
#                carry: .gguf/part.aa .gguf/gguf-0.19.0-py3-none-any.whl
#                       .gguf/sharegpt_first_turns.jsonl.gz .gguf/mtbench.jsonl      (~52 MiB)
#   GPU call 2:  bash scripts/gpu_stage_gguf.sh receive ab && bash scripts/gpu_stage_gguf.sh finish
#                && bash scripts/gpu_headline.sh regen 360
#                carry: .gguf/part.ab .gguf/gguf-0.19.0-py3-none-any.whl
#   GPU call 3:  bash scripts/gpu_headline.sh train 300                    carry: none
#   GPU call 4:  bash scripts/gpu_headline.sh bench                        carry: none
#   here after 3: cat <files_at>/drafter.tar.part-* | tar -x -C runs/   (-> runs/smollm2-headline/)
#
# CPU check of the whole flow (here; a 12-prompt subset replaces firsts.jsonl after `receive`):
#   export WORK=/tmp/ghw OUT=/tmp/x DEVICE=cpu DTYPE=float32 REGEN_BATCH=4 MAX_NEW=16 TRAIN_BATCH=2 \
#          PROBE_STEPS=3 EPOCHS=1 TTT_STEPS=2 EVAL_EVERY=2 WORKERS=2 BENCH_PROMPTS=2 BENCH_NEW=8
#
# Budget (device time): call 1 ~1 min; call 2 ~1 min convert + 6 min regen + 0.5 min stats;
# call 3 ~1 min tokenize/vocab + ~1 min probe + 5 min training + ~1 min eval/export;
# call 4 ~5 min (bench_engine runs HF eager too, ~7.5 s a prompt: hence 24 prompts). ~23 min.
# A stage cut off by the 10-minute limit resumes when rerun (regen appends; train resumes from
# its checkpoint with the same planned step count). Every stage prints the device time it used.
#
# Knobs (environment), defaults for the H200; the CPU check in the report scales them down:
#   WORK OUT DEVICE DTYPE  REGEN_BATCH MAX_NEW LIMIT  TRAIN_BATCH MAX_LEN VOCAB_SIZE EPOCHS LR
#   TTT_STEPS PROBE_STEPS EVAL_EVERY WORKERS  BENCH_PROMPTS BENCH_NEW
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${WORK:-/tmp/fledge_headline}
OUT=${OUT:-$WORK/out}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
STAGE=.gguf
TARGET=smollm2-135m
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
if [[ -z ${FLEDGE_SMOLLM2_DIR:-} && -d /tmp/fledge_gguf/smollm2 ]]; then
    export FLEDGE_SMOLLM2_DIR=/tmp/fledge_gguf/smollm2   # left by gpu_stage_gguf.sh finish
fi
fledge() { python3 -m fledge.cli "$@"; }
data() { python3 scripts/gpu_prepare_data.py "$@"; }
target_dir() { python3 -c "from fledge.target import resolve_target as r; print(r('$TARGET'))"; }
report_time() { echo "== gpu_headline $1: ${SECONDS}s device time (this stage)"; }

prepare() {
    [[ -f $STAGE/part.aa && -f $STAGE/part.ab ]] || bash scripts/gpu_stage_gguf.sh prepare
    local tmp
    tmp=$(mktemp -d)
    fledge prep sharegpt -o "$tmp/sharegpt" --heldout 256
    data firsts "$tmp/sharegpt" "$STAGE/sharegpt_first_turns.jsonl.gz"
    fledge prep mtbench -o "$tmp/mtbench"          # all 80 land in heldout.jsonl (--heldout 500)
    cp "$tmp/mtbench/heldout.jsonl" "$STAGE/mtbench.jsonl.tmp" && mv "$STAGE/mtbench.jsonl.tmp" "$STAGE/mtbench.jsonl"
    rm -rf "$tmp"
    ls -l "$STAGE"
}

receive() {
    for f in sharegpt_first_turns.jsonl.gz mtbench.jsonl; do
        [[ -f $STAGE/$f ]] || { echo "gpu_headline: $STAGE/$f not here; carry it with this call" >&2; exit 2; }
    done
    mkdir -p "$WORK"
    gunzip -c "$STAGE/sharegpt_first_turns.jsonl.gz" > "$WORK/firsts.jsonl.tmp"
    mv "$WORK/firsts.jsonl.tmp" "$WORK/firsts.jsonl"
    cp "$STAGE/mtbench.jsonl" "$WORK/mtbench.jsonl"
    wc -l "$WORK/firsts.jsonl" "$WORK/mtbench.jsonl"
    report_time receive
}

regen() {
    local budget=$1 rc=0
    [[ -f $WORK/firsts.jsonl ]] || { echo "gpu_headline: $WORK/firsts.jsonl missing; run 'receive' first" >&2; exit 2; }
    mkdir -p "$OUT"
    [[ -f $WORK/regen.jsonl ]] && data regen-stats "$WORK/regen.jsonl" "$WORK/regen_before.json" --tokenizer "$(target_dir)" >/dev/null
    local t0=$SECONDS
    # SIGINT at the budget: regen appends whole samples with fsync, so only the in-flight chunk is lost.
    timeout -s INT -k 30 "$budget" python3 -m fledge.cli regen "$WORK/firsts.jsonl" "$WORK/regen.jsonl" \
        --device "$DEVICE" --dtype "$DTYPE" --batch-size "${REGEN_BATCH:-256}" --chunk "${REGEN_BATCH:-256}" \
        --max-new-tokens "${MAX_NEW:-512}" --max-turns 1 ${LIMIT:+--limit "$LIMIT"} || rc=$?
    case $rc in
        0) echo "regen: every conversation answered" ;;
        124|137) echo "regen: stopped at the ${budget}s budget (rerun to continue)" ;;
        *) echo "gpu_headline: regen failed (exit $rc)" >&2; exit "$rc" ;;
    esac
    data regen-stats "$WORK/regen.jsonl" "$OUT/regen_stats.json" --tokenizer "$(target_dir)" \
        --previous "$WORK/regen_before.json" --seconds $((SECONDS - t0))
    rm -f "$WORK/regen_before.json"
    report_time regen
}

train() {
    local budget=$1 batch=${TRAIN_BATCH:-16} max_len=${MAX_LEN:-2048} probe_steps=${PROBE_STEPS:-30}
    [[ -s $WORK/regen.jsonl ]] || { echo "gpu_headline: $WORK/regen.jsonl missing; run 'regen' first" >&2; exit 2; }
    mkdir -p "$OUT"
    local tok
    tok=$(target_dir)
    if [[ ! -f $WORK/train.tok.jsonl ]]; then   # regen is final once training starts
        data split "$WORK/regen.jsonl" "$WORK/train.jsonl" "$WORK/heldout.jsonl"
        data tokenize "$WORK/heldout.jsonl" "$WORK/heldout.tok.jsonl" --tokenizer "$tok" --max-len "$max_len" \
            --workers "${WORKERS:-$(nproc)}"
        data tokenize "$WORK/train.jsonl" "$WORK/train.tok.jsonl" --tokenizer "$tok" --max-len "$max_len" \
            --workers "${WORKERS:-$(nproc)}"
    fi
    [[ -f $WORK/vocab.safetensors ]] || fledge vocab build "$WORK/train.tok.jsonl" --target "$TARGET" \
        --size "${VOCAB_SIZE:-16384}" --heldout "$WORK/heldout.tok.jsonl" -o "$WORK/vocab.safetensors"
    local common=(--target "$TARGET" --data "$WORK/train.tok.jsonl" --vocab "$WORK/vocab.safetensors"
                  --batch-size "$batch" --max-len "$max_len" --lr "${LR:-1e-4}" --ttt-steps "${TTT_STEPS:-7}"
                  --device "$DEVICE")
    if [[ ! -f $WORK/plan.json ]]; then   # kept: a resumed run must plan the same step count
        local t0=$SECONDS
        rm -rf "$WORK/probe"
        fledge train "${common[@]}" --out "$WORK/probe" --max-steps "$probe_steps" --eval-samples 0 \
            --log-every $(( (probe_steps + 2) / 3 )) --eval-every 1000000 --save-every 1000000
        echo "probe: $((SECONDS - t0))s"
        data plan-steps "$WORK/probe/metrics.jsonl" "$WORK/train.tok.jsonl" "$WORK/plan.json" \
            --batch "$batch" --seconds "$budget" --epochs "${EPOCHS:-3}"
    fi
    local steps t1=$SECONDS
    steps=$(python3 -c "import json; print(json.load(open('$WORK/plan.json'))['max_steps'])")
    if [[ ! -f $WORK/run/result.json ]]; then   # written last: a killed run resumes from its checkpoint
        fledge train "${common[@]}" --out "$WORK/run" --max-steps "$steps" --eval-data "$WORK/heldout.tok.jsonl" \
            --log-every 20 --eval-every "${EVAL_EVERY:-200}" --save-every 200
        echo "training: $((SECONDS - t1))s for $steps steps"
    fi
    fledge export "$WORK/run/draft" "$WORK/drafter" --shard-size-mb 15 --overwrite
    bring_home "$tok"
    report_time train
}

bring_home() {
    # lm_head alone is 16384 x 576 bf16 = 18 MiB, over the 16 MiB a returned file may have, so
    # the drafter comes home as a tar in 15 MiB pieces.
    local bytes
    bytes=$(du -cb "$WORK"/drafter/* | tail -1 | cut -f1)
    (( bytes <= 32000000 )) || { echo "gpu_headline: drafter is $bytes bytes (> 32 MB)" >&2; exit 1; }
    python3 -c "
import sys; from pathlib import Path; from safetensors import safe_open
keys = [k for f in Path(sys.argv[1]).glob('*.safetensors') for k in safe_open(str(f), 'pt').keys()]
sys.exit('gpu_headline: the drafter holds embed_tokens' if any('embed_tokens' in k for k in keys) else 0)" "$WORK/drafter"
    rm -f "$OUT"/drafter.tar.part-*
    tar -C "$WORK" --transform 's,^drafter,smollm2-headline,' -cf - drafter | split -b 15M - "$OUT/drafter.tar.part-"
    cp "$WORK/run/metrics.jsonl" "$OUT/"
    [[ -f $WORK/run/curves.png ]] && cp "$WORK/run/curves.png" "$OUT/"
    python3 - "$WORK" "$OUT/train_summary.json" "$bytes" <<'EOF'
import json, sys
from pathlib import Path
from fledge.util import atomic_write_json
w = Path(sys.argv[1])
read = lambda p: json.loads((w / p).read_text())
atomic_write_json(sys.argv[2], {"tokenize_train": read("train.tok.jsonl.stats.json"),
                                "tokenize_heldout": read("heldout.tok.jsonl.stats.json"),
                                "vocab": read("vocab.json"), "plan": read("plan.json"),
                                "result": read("run/result.json"), "drafter_bytes": int(sys.argv[3])})
EOF
    ls -l "$OUT"
}

bench() {
    [[ -f $WORK/drafter/config.json ]] || { echo "gpu_headline: $WORK/drafter missing; run 'train' first" >&2; exit 2; }
    mkdir -p "$OUT"
    python3 bench/bench_engine.py --target "$TARGET" --drafter "$WORK/drafter" --tree 5,4,16 \
        --prompts "$WORK/mtbench.jsonl" --num-prompts "${BENCH_PROMPTS:-24}" --max-new-tokens "${BENCH_NEW:-256}" \
        --device "$DEVICE" --dtype "$DTYPE" --out "$OUT/bench_engine.json" 2>&1 | tee "$OUT/bench_engine.log"
    report_time bench
}

case "${1:-}" in
    prepare) prepare ;;
    receive) receive ;;
    regen) [[ $# -eq 2 ]] || { echo "usage: $0 regen SECONDS" >&2; exit 2; }; regen "$2" ;;
    train) [[ $# -eq 2 ]] || { echo "usage: $0 train SECONDS" >&2; exit 2; }; train "$2" ;;
    bench) bench ;;
    *) echo "usage: $0 prepare | receive | regen SECONDS | train SECONDS | bench" >&2; exit 2 ;;
esac
