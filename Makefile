# Two commands do all set-up on a fresh machine: `make test` and `make demo`.
# Both create/update .venv (skipped when nothing changed); see scripts/setup_venv.sh.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: venv test test-oldest test-torch-2.11 demo bench bench-peers-deps lint clean

venv:
	@bash scripts/setup_venv.sh

test: venv
	$(PY) -m pytest tests $(PYTEST_ARGS)

# The oldest supported torch/megatron-core (constraints-oldest.txt) in .venv-oldest: single-process
# tests and one 2-rank parity test (scripts/test_oldest.sh; CI's second run).
test-oldest:
	@bash scripts/test_oldest.sh

# The same check with torch 2.11 (the GPU machines' torch), in its own .venv-torch-2.11.
test-torch-2.11:
	@VENV_OLDEST=.venv-torch-2.11 TORCH_VERSION=2.11.0 bash scripts/test_oldest.sh

demo: venv
	$(PY) -m megatron_muon.demo

bench: venv bench-peers-deps
	$(PY) -m benchmarks

# The peers `make bench` compares with (docs/benchmarks.md, "Peers"): bench extras, never install
# requirements of megatron-muon. --no-deps: each would otherwise pull its own torch; what they import
# beyond torch is listed here (spmd_types for torchtitan's flex_shard).
PEERS := muon-fsdp2==0.3.0 muonium==0.2.0 torchtitan==0.3.0 spmd-types==0.3.1
bench-peers-deps: venv
	$(PY) -m pip install -q --no-deps $(PEERS)

# ruff (lint and format) on all code, mypy on the package ([tool.mypy] in pyproject.toml), then the
# size limits (module <= 400 lines, class <= 300) and `type: ignore[code]  # reason`
# (scripts/check_code_shape.py).
LINTED := megatron_muon tests benchmarks examples scripts
lint: venv
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(PY) -m mypy
	$(PY) scripts/check_code_shape.py megatron_muon

clean:
	rm -rf .venv .venv-oldest .venv-torch-2.11 bench_out demo_out
