# Two commands do all set-up on a fresh machine: `make test` and `make demo`.
# Both create/update .venv (skipped when nothing changed); see scripts/setup_venv.sh.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: venv test test-avx2 test-oldest test-torch-2.11 test-bridge demo bench bench-peers-deps \
	lint clean gpu-wheels

venv:
	@bash scripts/setup_venv.sh

test: venv
	$(PY) -m pytest tests $(PYTEST_ARGS)

# The multi-rank parity tests again with the CPU kernels limited to AVX2, as on a CPU without
# AVX-512 (e.g. AMD Zen 3): each variable changes kernels torch picks (ATEN_CPU_CAPABILITY: aten's
# vectorized ops such as softmax; ONEDNN_MAX_CPU_ISA: bf16 matmuls; MKL_ENABLE_INSTRUCTIONS: fp32
# matmuls; scripts/show_cpu_kernels.py shows the bits change). CI's second pass (.ci/run).
# On a CPU where the limits change none of those bits (no AVX-512: `make test` already ran these
# kernels) the pass says so and runs nothing (show_cpu_kernels.py --compare-unlimited exits 3).
# TORCHDYNAMO_DISABLE: under the MKL / oneDNN limits the C++ kernel Inductor compiles for Megatron's
# JIT warm-up (bias_gelu, run and discarded at start-up) aborts the process; nothing the tests
# compare is compiled code (their flags turn the fusions off).
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
	TORCHDYNAMO_DISABLE=1
PARITY_TESTS := tests/test_factory.py tests/test_grad_sync.py tests/test_factory_qk_clip.py \
	tests/test_gram_newton_schulz_parity.py tests/test_sharded_muon.py \
	tests/test_sharded_muon_layouts.py tests/test_tensor_parallel.py tests/test_mla.py \
	tests/test_qk_clip.py tests/test_mla_qk_clip.py \
	tests/test_megatron_lm_loop.py
test-avx2: venv
	@$(AVX2_ENV) $(PY) scripts/show_cpu_kernels.py --compare-unlimited; status=$$?; \
	if [ $$status -eq 3 ]; then \
	  echo "test-avx2: not run: the AVX2 limits change no kernel on this CPU, so make test ran these"; \
	  echo "           parity tests with AVX2 kernels already"; \
	  exit 0; \
	fi; \
	[ $$status -eq 0 ] || exit $$status; \
	$(AVX2_ENV) $(PY) -m pytest $(PARITY_TESTS) $(PYTEST_ARGS)

# The oldest supported torch/megatron-core (constraints-oldest.txt) in .venv-oldest: single-process
# tests and one 2-rank parity test (scripts/test_oldest.sh; CI's second run).
test-oldest:
	@bash scripts/test_oldest.sh

# The same check with torch 2.11 (the GPU machines' torch), in its own .venv-torch-2.11.
test-torch-2.11:
	@VENV_OLDEST=.venv-torch-2.11 TORCH_VERSION=2.11.0 bash scripts/test_oldest.sh

# Megatron-Bridge's pretrain with megatron_muon.integrations.megatron_bridge (tests/bridge/), in
# .venv-bridge: Bridge pinned exactly (constraints-bridge.txt) on top of .venv's stack
# (scripts/setup_bridge_venv.sh says what it installs and why; docs/megatron_bridge.md). Elsewhere
# these tests are skipped.
test-bridge: venv
	@bash scripts/setup_bridge_venv.sh
	.venv-bridge/bin/python -m pytest tests/bridge -p no:cacheprovider $(PYTEST_ARGS)

demo: venv
	$(PY) -m megatron_muon.demo

# Every section, the peers, ideal-ratio and overlap ones included (docs/benchmarks.md). On 2 CPU
# cores ~36 min, ~55 where bf16 is emulated and NS runs in fp32 (benchmarks/__main__.py's
# STATED_MINUTES, which the run's progress lines state). `python -m benchmarks` without --peers
# leaves those three out.
bench: venv bench-peers-deps
	$(PY) -m benchmarks --peers

# The peers `make bench` compares with (docs/benchmarks.md, "Peers"): bench extras, never install
# requirements of megatron-muon. --no-deps: each would otherwise pull its own torch; what they import
# beyond torch is listed here (spmd_types, tyro and its docstring_parser for torchtitan's
# flex_shard).
PEERS := muon-fsdp2==0.3.0 muonium==0.2.0 torchtitan==0.3.0 spmd-types==0.3.1 tyro==1.0.17 \
	docstring-parser==0.18.0
bench-peers-deps: venv
	$(PY) -m pip install -q --no-deps $(PEERS)

# The wheels scripts/gpu_check.sh installs on a bare GPU machine (torch there, no megatron; docs/gpu.md):
# megatron-core, megatron-fsdp, emerging-optimizers at constraints.txt's versions, for CPython 3.12.
GPU_WHEELS := megatron-core megatron-fsdp emerging-optimizers
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		-d .whl $(foreach p,$(GPU_WHEELS),$(shell grep -i "^$(p)==" constraints.txt))
	@ls .whl

# ruff (lint and format) on all code, mypy on the package ([tool.mypy] in pyproject.toml), then the
# size limits (module <= 400 lines, class <= 300) and `type: ignore[code]  # reason`
# (scripts/check_code_shape.py), then that the subpackages import each other one way
# (scripts/check_import_layers.py; docs/architecture.md).
LINTED := megatron_muon tests benchmarks examples scripts
lint: venv
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(PY) -m mypy
	$(PY) scripts/check_code_shape.py megatron_muon
	$(PY) scripts/check_import_layers.py megatron_muon

clean:
	rm -rf .venv .venv-oldest .venv-torch-2.11 .venv-bridge bench_out demo_out
