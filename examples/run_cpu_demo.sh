#!/usr/bin/env bash
# The main job on CPU: a tiny GPT, real data (CPython stdlib + Shakespeare, Qwen2 BPE), trained in
# Megatron's own pretrain() by torchrun with 4 processes (gloo): pipeline parallel 2 x data
# parallel 2, --sparse-balance (block-sparse attention + DST + SAB). `make demo` runs this.
# Options: TRAIN_ITERS (30), NPROC (4), PP (2), SB_FLAGS (empty: a dense run), OUT (runs/demo),
# RESUME=1 (`make demo-resume`): continue from the checkpoint in $OUT/checkpoints (weights, data
# position and the balancer's state) up to TRAIN_ITERS (default then: 10 more than it holds).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NPROC=${NPROC:-4}
PP=${PP:-2}
OUT=${OUT:-runs/demo}
LOAD=()
if [ "${RESUME:-0}" = 1 ]; then
  latest="$OUT/checkpoints/latest_checkpointed_iteration.txt"
  if [ ! -f "$latest" ]; then
    echo "error: RESUME=1: no checkpoint in $OUT/checkpoints ($latest is missing); run 'make demo' first" >&2
    exit 2
  fi
  saved=$(cat "$latest")
  TRAIN_ITERS=${TRAIN_ITERS:-$((saved + 10))}
  if [ "$TRAIN_ITERS" -le "$saved" ]; then
    echo "error: RESUME=1 TRAIN_ITERS=$TRAIN_ITERS: the checkpoint in $OUT/checkpoints is at iteration $saved; pass TRAIN_ITERS above it" >&2
    exit 2
  fi
  echo "resuming $OUT/checkpoints from iteration $saved to $TRAIN_ITERS"
  # the learning-rate schedule is the checkpoint's (cosine over the first run's iterations, then
  # --min-lr): a longer TRAIN_ITERS would change it, which Megatron refuses on load
  LOAD=(--load "$OUT/checkpoints" --use-checkpoint-opt-param-scheduler)
fi
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
  examples/pretrain_gpt_sparsebalance.py \
  --num-layers 4 --hidden-size 128 --ffn-hidden-size 384 --num-attention-heads 4 \
  --group-query-attention --num-query-groups 2 \
  --seq-length 1024 --max-position-embeddings 1024 \
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
  --untie-embeddings-and-output-weights \
  --attention-dropout 0 --hidden-dropout 0 \
  --micro-batch-size 1 --global-batch-size 4 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 3 --clip-grad 1.0 \
  --train-iters "${TRAIN_ITERS:-30}" --log-interval 5 \
  --eval-interval 15 --eval-iters 2 \
  --pipeline-model-parallel-size "$PP" \
  --save "$OUT/checkpoints" --save-interval 1000 \
  --tensorboard-dir "$OUT/tensorboard" \
  --sb-doc-unit section --sb-metrics-file "$OUT/metrics.jsonl" \
  ${SB_FLAGS---sparse-balance --sb-density 0.5 --sb-block-size 64} \
  "${LOAD[@]}" "$@"
