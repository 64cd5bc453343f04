#!/usr/bin/env bash
# The `fledge adapt` experiment (issue 7): retarget the headline drafter (OLD, for SmolLM2-135M-
# Instruct) to NEW = SmolLM2-135M-Instruct fine-tuned on ChatGPT's answers to ShareGPT code
# prompts, and measure it against drafters trained from scratch on NEW. Stages are resumable and
# idempotent (each sub-step is skipped when its output exists; a killed one continues when
# rerun); state lives in $WORK/adapt next to gpu_headline.sh's, small results go to $OUT.
#
#   here (CPU):  bash scripts/gpu_adapt.sh prepare     -> .gguf/adapt_code.jsonl.gz
#   GPU call 1:  bash scripts/gpu_adapt.sh new         carry: .gguf/adapt_code.jsonl.gz  (~6 min)
#                (or $WORK/adapt_code.jsonl.gz, where gpu_headline.sh receive leaves it)
#                unpack, tokenize, fine-tune NEW (finetune_target.py), NEW answers the code-train
#                and held-out prompts (regen), OLD answers the held-out ones, the shift
#                (adapt_experiment.py shift), NEW's tokenized sets and draft vocab, then the
#                from-scratch drafter "to completion" (FULL_STEPS)
#   GPU call 2:  bash scripts/gpu_adapt.sh compare     carry: none                        (~4 min)
#                first finishes whatever `new` left undone (a time limit cut it), then, with
#                $WORK/drafter (gpu_headline.sh train): `fledge adapt` for BUDGET_STEPS, a
#                scratch drafter for BUDGET_STEPS, the engine's accept length of OLD as-is,
#                adapted, scratch (budget) and scratch (full), then $OUT/adapt_report.json,
#                adapt_metrics_{adapted,scratch_budget,scratch_full}.jsonl, adapt_curves.png
# FLEDGE_SMOLLM2_DIR is the caller's (as for gpu_headline.sh); CUDA_VISIBLE_DEVICES picks the GPU
# (gpu_headline.sh's train and bench stages run `new` and `compare` on GPU 1 as side work). A
# stage cut by a time limit (SIGINT) loses at most the running sub-step's progress since its last
# save (regen: the chunk in flight; training: SAVE_EVERY steps; the fine-tune: all of it); rerun.
#
# Data (adapt_experiment.py select; ShareGPT through `fledge prep`, --heldout 256 as the headline):
# 1076 code-finetune, 1076 code-train, 54 code-heldout conversations, 1.0 MB. Prep's held-out
# split holds only 54 code conversations whose prompt fits, short of the 64 aimed at.
#
# CPU check of the whole flow (after gpu_headline.sh's CPU check through `train`, same WORK):
#   export WORK=/tmp/adapt_cpu OUT=/tmp/adapt_cpu/out DEVICE=cpu DTYPE=float32 ADAPT_FINETUNE=8 \
#          ADAPT_TRAIN=8 ADAPT_HELDOUT=3 FT_STEPS=2 FT_BATCH=2 MAX_LEN=512 REGEN_BATCH=8 MAX_NEW=16 \
#          TRAIN_BATCH=2 TTT_STEPS=2 FULL_STEPS=8 BUDGET_STEPS=4 ENGINE_PROMPTS=2 ENGINE_NEW=16 WORKERS=2
#
# Knobs (environment), defaults for the H200:
#   WORK OUT DEVICE DTYPE  ADAPT_FINETUNE ADAPT_TRAIN ADAPT_HELDOUT (caps at unpack; default all)
#   FT_STEPS FT_BATCH FT_LR  REGEN_BATCH MAX_NEW  TRAIN_BATCH MAX_LEN VOCAB_SIZE LR TTT_STEPS
#   FULL_STEPS BUDGET_STEPS SAVE_EVERY WORKERS  ENGINE_PROMPTS ENGINE_NEW
# Names shared with gpu_headline.sh mean the same there (and the side runs inherit its values);
# LR defaults to its 3e-4, so every drafter here trains as OLD's did.
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${WORK:-/tmp/fledge_headline}
OUT=${OUT:-$WORK/out}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
STAGE=.gguf
PACKED=$STAGE/adapt_code.jsonl.gz
[[ -f $PACKED || ! -f $WORK/adapt_code.jsonl.gz ]] || PACKED=$WORK/adapt_code.jsonl.gz   # copied there by receive
OLD=smollm2-135m
A=$WORK/adapt
HELDOUT=256   # must be gpu_headline.sh's: prep's held-out split is then the one OLD's drafter never saw
FT_STEPS=${FT_STEPS:-300} FT_BATCH=${FT_BATCH:-16} FT_LR=${FT_LR:-2e-5}
REGEN_BATCH=${REGEN_BATCH:-256} MAX_NEW=${MAX_NEW:-512}
TRAIN_BATCH=${TRAIN_BATCH:-16} MAX_LEN=${MAX_LEN:-2048} VOCAB_SIZE=${VOCAB_SIZE:-16384} LR=${LR:-3e-4}
TTT_STEPS=${TTT_STEPS:-7} FULL_STEPS=${FULL_STEPS:-1000} BUDGET_STEPS=${BUDGET_STEPS:-250}
SAVE_EVERY=${SAVE_EVERY:-50} WORKERS=${WORKERS:-4} ENGINE_PROMPTS=${ENGINE_PROMPTS:-32} ENGINE_NEW=${ENGINE_NEW:-256}
ADAPT_FINETUNE=${ADAPT_FINETUNE:-} ADAPT_TRAIN=${ADAPT_TRAIN:-} ADAPT_HELDOUT=${ADAPT_HELDOUT:-}
KNOBS="DEVICE DTYPE ADAPT_FINETUNE ADAPT_TRAIN ADAPT_HELDOUT FT_STEPS FT_BATCH FT_LR REGEN_BATCH MAX_NEW TRAIN_BATCH
       MAX_LEN VOCAB_SIZE LR TTT_STEPS FULL_STEPS BUDGET_STEPS SAVE_EVERY ENGINE_PROMPTS ENGINE_NEW"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
if [[ -z ${FLEDGE_SMOLLM2_DIR:-} && -d /tmp/fledge_gguf/smollm2 ]]; then
    export FLEDGE_SMOLLM2_DIR=/tmp/fledge_gguf/smollm2   # left by gpu_stage_gguf.sh finish
fi
fledge() { python3 -m fledge.cli "$@"; }
data() { python3 scripts/gpu_prepare_data.py "$@"; }
exp() { python3 scripts/adapt_experiment.py "$@"; }
target_dir() { python3 -c "from fledge.target import resolve_target as r; print(r('$OLD'))"; }
report_time() { echo "== gpu_adapt $1: ${SECONDS}s device time (this stage)"; }
need() { [[ -e $1 ]] || { echo "gpu_adapt: $1 missing; $2" >&2; exit 2; }; }
every() { echo $(( $1 / 10 > 0 ? $1 / 10 : 1 )); }   # eval interval: ten evals a run

step() {  # step NAME DONE CMD...: run CMD unless DONE exists; print and log its seconds and command line
    local name=$1 done=$2 t0=$SECONDS
    shift 2
    if [[ -e $done ]]; then echo "== $name: done already ($done)"; return; fi
    "$@"
    [[ -e $done ]] || { echo "gpu_adapt: $name finished without writing $done" >&2; exit 1; }
    echo "== $name: $((SECONDS - t0))s"
    printf '%s\t%ss\t%s\n' "$name" "$((SECONDS - t0))" "$*" >> "$A/commands.log"
}

prepare() {
    local tmp
    tmp=$(mktemp -d)
    fledge prep sharegpt -o "$tmp/sharegpt" --heldout "$HELDOUT"
    exp select "$tmp/sharegpt" "$PACKED" --tokenizer "$OLD" --max-prompt-tokens $((2048 - 512))
    rm -rf "$tmp"
    ls -l "$PACKED"
}

new() {
    [[ -f $A/unpack.json ]] || need "$PACKED" "carry it with this call (made by 'gpu_adapt.sh prepare')"
    mkdir -p "$A"
    local old_tok regen=(--device "$DEVICE" --dtype "$DTYPE" --batch-size "$REGEN_BATCH" --chunk "$REGEN_BATCH"
                         --max-new-tokens "$MAX_NEW" --max-turns 1)
    old_tok=$(target_dir)
    step unpack "$A/unpack.json" exp unpack "$PACKED" "$A" ${ADAPT_FINETUNE:+--finetune "$ADAPT_FINETUNE"} \
        ${ADAPT_TRAIN:+--train "$ADAPT_TRAIN"} ${ADAPT_HELDOUT:+--heldout "$ADAPT_HELDOUT"}
    step tokenize-finetune "$A/finetune.tok.jsonl.stats.json" data tokenize "$A/finetune.jsonl" \
        "$A/finetune.tok.jsonl" --tokenizer "$old_tok" --max-len "$MAX_LEN" --workers "$WORKERS"
    step finetune "$A/new" python3 scripts/finetune_target.py --target "$OLD" --data "$A/finetune.tok.jsonl" \
        --out "$A/new" --steps "$FT_STEPS" --batch-size "$FT_BATCH" --lr "$FT_LR" --max-len "$MAX_LEN" \
        --device "$DEVICE"
    # regen appends and resumes; its summary is written only when every prompt is answered.
    step regen-new "$A/regen_new.summary.json" fledge regen "$A/prompts.jsonl" "$A/regen_new.jsonl" \
        --target "$A/new" "${regen[@]}"
    step regen-old "$A/regen_old.summary.json" fledge regen "$A/heldout_prompts.jsonl" "$A/regen_old.jsonl" \
        --target "$OLD" "${regen[@]}"
    step split "$A/heldout.jsonl" data split "$A/regen_new.jsonl" "$A/train.jsonl" "$A/heldout.jsonl"
    for part in heldout train; do
        step "tokenize-$part" "$A/$part.tok.jsonl.stats.json" data tokenize "$A/$part.jsonl" "$A/$part.tok.jsonl" \
            --tokenizer "$A/new" --max-len "$MAX_LEN" --workers "$WORKERS"
    done
    step shift "$A/shift.json" exp shift --old "$OLD" --new "$A/new" --heldout-tok "$A/heldout.tok.jsonl" \
        --new-answers "$A/heldout.jsonl" --old-answers "$A/regen_old.jsonl" --out "$A/shift.json" \
        --device "$DEVICE" --dtype "$DTYPE"
    step vocab "$A/vocab.safetensors" fledge vocab build "$A/train.tok.jsonl" --target "$A/new" --size "$VOCAB_SIZE" \
        --heldout "$A/heldout.tok.jsonl" -o "$A/vocab.safetensors"
    step scratch-full "$A/scratch_full/result.json" fledge train "${train_common[@]}" --vocab "$A/vocab.safetensors" \
        --out "$A/scratch_full" --max-steps "$FULL_STEPS" --eval-every "$(every "$FULL_STEPS")"
    report_time new
}

compare() {
    need "$WORK/drafter/config.json" "run 'gpu_headline.sh train' first (OLD's drafter)"
    new   # every step done already, unless a time limit cut `new` short
    step adapt "$A/adapted/train/draft/config.json" fledge adapt --drafter "$WORK/drafter" "${train_common[@]}" \
        --out "$A/adapted" --draft-vocab "$VOCAB_SIZE" --max-steps "$BUDGET_STEPS" \
        --eval-every "$(every "$BUDGET_STEPS")"
    step scratch-budget "$A/scratch_budget/result.json" fledge train "${train_common[@]}" \
        --vocab "$A/vocab.safetensors" --out "$A/scratch_budget" --max-steps "$BUDGET_STEPS" \
        --eval-every "$(every "$BUDGET_STEPS")"
    # Not a `step`: engine.json is resumed per drafter, and redone when the settings change.
    local t0=$SECONDS engine=(exp engine --target "$A/new" --prompts "$A/heldout.jsonl" --num-prompts "$ENGINE_PROMPTS"
        --max-new-tokens "$ENGINE_NEW" --device "$DEVICE" --dtype "$DTYPE" --cache "$A/engine.json"
        --drafter "old=$WORK/drafter" --drafter "adapted=$A/adapted/train/draft"
        --drafter "scratch_budget=$A/scratch_budget/draft" --drafter "scratch_full=$A/scratch_full/draft")
    "${engine[@]}"
    echo "== engine: $((SECONDS - t0))s"
    printf '%s\t%ss\t%s\n' engine "$((SECONDS - t0))" "${engine[*]}" >> "$A/commands.log"
    mkdir -p "$OUT"
    local knobs="" k
    for k in $KNOBS; do knobs+="$k=${!k} "; done
    exp report "$A" "$OUT/adapt_report.json" --knobs "$knobs" --full-steps "$FULL_STEPS" --budget-steps "$BUDGET_STEPS"
    ls -l "$OUT"
    report_time compare
}

# Every drafter on NEW trains with the same data, eval set and knobs (gpu_headline.sh's).
train_common=(--target "$A/new" --data "$A/train.tok.jsonl" --eval-data "$A/heldout.tok.jsonl"
              --batch-size "$TRAIN_BATCH" --max-len "$MAX_LEN" --lr "$LR" --ttt-steps "$TTT_STEPS"
              --log-every 20 --save-every "$SAVE_EVERY" --device "$DEVICE")

case "${1:-}" in
    prepare) prepare ;;
    new) new ;;
    compare) compare ;;
    *) echo "usage: $0 prepare | new | compare" >&2; exit 2 ;;
esac
