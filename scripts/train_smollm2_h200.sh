#!/usr/bin/env bash
# Headline run: an EAGLE-3 drafter for SmolLM2-135M-Instruct on one H200, online features
# (the target is so small that running it in the loop is cheaper than writing shards).
#
#   DATA=/path/train.jsonl scripts/train_smollm2_h200.sh        # tokenized, regenerated set
#
# Knobs (environment): OUT, VOCAB_SIZE, BATCH, EPOCHS, LR, MAX_STEPS, GPUS (>1: torchrun DDP).
# The target resolves through FLEDGE_SMOLLM2_DIR when set (no download).
set -euo pipefail
: "${DATA:?set DATA to the tokenized training set JSONL}"
OUT=${OUT:-runs/smollm2-eagle3}
VOCAB_SIZE=${VOCAB_SIZE:-16384}   # SmolLM2's vocab is 49152; the lm_head is the draft's largest cost
BATCH=${BATCH:-16}                # sequences per GPU per micro-batch (<= 32K tokens at max-len 2048)
EPOCHS=${EPOCHS:-1}
LR=${LR:-1e-4}
GPUS=${GPUS:-1}
mkdir -p "$OUT"

[ -f "$OUT/vocab.safetensors" ] || fledge vocab build "$DATA" --target smollm2-135m --size "$VOCAB_SIZE" -o "$OUT/vocab.safetensors"

args=(train --target smollm2-135m --data "$DATA" --vocab "$OUT/vocab.safetensors" --out "$OUT/run"
      --batch-size "$BATCH" --max-len 2048 --epochs "$EPOCHS" --lr "$LR" --ttt-steps 7
      --log-every 20 --eval-every 200 --save-every 200 --eval-samples 128)
[ -n "${MAX_STEPS:-}" ] && args+=(--max-steps "$MAX_STEPS")
if [ "$GPUS" -gt 1 ]; then
  torchrun --standalone --nproc_per_node "$GPUS" -m fledge.cli "${args[@]}"
else
  fledge "${args[@]}"
fi
