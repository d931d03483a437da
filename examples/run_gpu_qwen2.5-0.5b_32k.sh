#!/usr/bin/env bash
# SparseBalance on GPUs: a Qwen2.5-0.5B-shaped GPT (24 layers, hidden 896, 14 query heads / 2 KV
# groups, head dim 64, SwiGLU FFN 4864, RMSNorm, RoPE base 1e6, QKV bias, tied embeddings, Qwen2
# vocabulary 151936) at 32K tokens per packed micro-batch, bf16, NCCL, torchrun.
#
#   DATA_PATH=/data/corpus.jsonl examples/run_gpu_qwen2.5-0.5b_32k.sh [extra Megatron/--sb-* flags]
#
# Environment (defaults in brackets):
#   DATA_PATH    required: a .jsonl file with a "text" field, or a Megatron indexed prefix
#                (tokenized with the Qwen2 tokenizer); the full 151936-row vocabulary is used
#   NPROC [8]    GPUs per node;  NNODES [1], NODE_RANK [0], MASTER_ADDR, MASTER_PORT [29500]
#   TP [1]       tensor parallel: 1 or 2 (14 heads and 2 query groups must divide by it);
#                TP > 1 turns on --sequence-parallel with transformer-engine
#   PP [1]       pipeline parallel: divides 24 layers (1, 2, 3, 4, 6, 8)
#                data parallel = NNODES * NPROC / (TP * PP)
#   GBS [64]     global batch size in packed 32K-token micro-batches;  TRAIN_ITERS [2000]
#   OUT [runs/qwen2.5-0.5b_32k]   checkpoints (--save/--load), metrics, latency table
#   SB_LATENCY_TABLE [$OUT/latency_table_pp$PP.json]   from sparsebalance-profile, see below
#   TRANSFORMER_IMPL [transformer_engine if importable, else local];  PY [python]
#                the local fallback runs without NVIDIA apex: no persistent layer norm, no fused
#                weight-gradient accumulation, no sequence parallelism (the flags below say so)
#
# The latency table: profile once per device kind, model shape and PP size, on one GPU:
#   sparsebalance-profile --num-layers 24 --hidden-size 896 --ffn-hidden-size 4864 \
#     --num-attention-heads 14 --num-query-groups 2 --kv-channels 64 --vocab-size 151936 \
#     --seq-length 32768 --pipeline-model-parallel-size "$PP" \
#     --sb-block-size 128 --sb-attention-backend flex --out "$SB_LATENCY_TABLE"
# Without a table the run profiles one at start-up on this device (slower start).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python}
NPROC=${NPROC:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
TP=${TP:-1}
PP=${PP:-1}
GBS=${GBS:-64}
TRAIN_ITERS=${TRAIN_ITERS:-2000}
OUT=${OUT:-runs/qwen2.5-0.5b_32k}
SB_LATENCY_TABLE=${SB_LATENCY_TABLE:-$OUT/latency_table_pp$PP.json}

die() { echo "error: $*" >&2; exit 2; }
[[ -n "${DATA_PATH:-}" ]] || die "set DATA_PATH to a .jsonl file (\"text\" field) or a Megatron indexed prefix"
case "$TP" in 1|2) ;; *) die "TP=$TP: 14 attention heads and 2 query groups need TP 1 or 2" ;; esac
(( 24 % PP == 0 )) || die "PP=$PP does not divide the 24 layers"
WORLD=$(( NNODES * NPROC ))
(( WORLD % (TP * PP) == 0 )) || die "world size $WORLD is not divisible by TP*PP=$((TP * PP))"

if [[ -z "${TRANSFORMER_IMPL:-}" ]]; then
  if "$PY" -c "import transformer_engine" >/dev/null 2>&1; then
    TRANSFORMER_IMPL=transformer_engine
  else
    TRANSFORMER_IMPL=local
  fi
fi
PARALLEL=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
IMPL=(--transformer-impl "$TRANSFORMER_IMPL")
if [[ "$TRANSFORMER_IMPL" == transformer_engine ]]; then
  if (( TP > 1 )); then PARALLEL+=(--sequence-parallel); fi
else
  # Megatron's GPU defaults need apex with the local implementation: turn them off.
  IMPL+=(--no-persist-layer-norm --no-gradient-accumulation-fusion --no-rope-fusion)
  echo "note: transformer-engine is not importable: --transformer-impl local (slower)" >&2
fi
TABLE=()
if [[ -f "$SB_LATENCY_TABLE" ]]; then
  TABLE=(--sb-latency-table "$SB_LATENCY_TABLE")
else
  echo "note: no latency table at $SB_LATENCY_TABLE; the run profiles one at start-up" \
       "(see the sparsebalance-profile command at the top of $0)" >&2
fi
if (( NNODES > 1 )); then
  LAUNCH=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR"
          --master_port "$MASTER_PORT")
else
  LAUNCH=(--standalone)
fi

mkdir -p "$OUT"
export CUDA_DEVICE_MAX_CONNECTIONS=1   # TP/SP communication overlap in Megatron
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

MODEL=(
  --num-layers 24 --hidden-size 896 --ffn-hidden-size 4864
  --num-attention-heads 14 --group-query-attention --num-query-groups 2 --kv-channels 64
  --seq-length 32768 --max-position-embeddings 32768
  --position-embedding-type rope --rotary-base 1000000
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
  --disable-bias-linear --add-qkv-bias
  --attention-dropout 0 --hidden-dropout 0
  # Qwen2 BPE ids up to 151850, padded to 151936 rows: 128 * TP must divide the padded size.
  --make-vocab-size-divisible-by $(( 128 / TP ))
)
TRAINING=(
  --micro-batch-size 1 --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS"
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 100
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02
  --bf16 --use-distributed-optimizer --overlap-grad-reduce
  "${IMPL[@]}" --distributed-backend nccl
)
SPARSEBALANCE=(
  --sparse-balance --sb-density 0.5 --sb-min-density 0.125 --sb-max-density 1.0
  --sb-block-size 128 --sb-attention-backend flex --sb-anchor mean --sb-tolerance 0.1
  --sb-tokenizer qwen --sb-metrics-file "$OUT/metrics.jsonl" "${TABLE[@]}"
)
IO=(
  --data-path "$DATA_PATH" --split 99,1,0
  --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 500
  --eval-interval 500 --eval-iters 10
  --log-interval 10 --tensorboard-dir "$OUT/tensorboard"
)

exec "$PY" -m torch.distributed.run "${LAUNCH[@]}" --nproc_per_node="$NPROC" \
  examples/pretrain_gpt_sparsebalance.py \
  "${MODEL[@]}" "${TRAINING[@]}" "${PARALLEL[@]}" "${SPARSEBALANCE[@]}" "${IO[@]}" "$@"
