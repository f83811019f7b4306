"""Muon on Megatron-FSDP with tensor parallelism: the DTensors megatron-core really builds.

``parallel_state.initialize_model_parallel`` with TP, megatron-core's ``FullyShardedDataParallel``
around the tiny GPTModel (QKV split over GQA query groups), ``build_muon_optimizer``, 3 steps
(``tests/tp_parity.py``): dense TP = 2, and experts with expert TP = 2 (``expt_tp``; MoE with
TP > 1 needs sequence parallelism, which the CPU-only local spec lacks). One launch trains every
case at TP x DP2 (4 ranks), one at TP x DP1 (2 ranks), for each tp_mode; ``layer_sharded`` is
also compared with ``duplicated`` bit for bit (the same NS of the same unsplit matrices). The
DP2 launch also runs ``layer_sharded`` with the NS of the MLP weights split over grid ranks
(``tp_parity.split_against_duplicated``).

Numerics (fp32, ``muon_fp32_matmul_prec="highest"``), measured on the pinned stack (AMD Zen 3,
2026-12-02):

- Against megatron-core's ``TensorParallelMuon`` + AdamW on the unsplit weights, fed the run's own
  reduced gradients (``tp_parity.reference_run``): **floor-judged** (tests/run_comparison.py)
  without a launch of its own: the floor is the same reference run again in the test process
  with the last bits of what it is fed changed: every gradient one ulp up, the global norm summed
  in fp64 (``reference_run(floor=True)``). Muon params differ from the reference by <= 4.7e-6
  relative: the router weight (expert case) and ``linear_proj.weight``, 2.5-4.7e-6 in every
  tp_mode at DP2 and DP1 alike. Their first gradients are nearly rank deficient
  (``linear_proj``: condition number 5e8-3e9, median singular value 140-165x below the
  largest), so Newton-Schulz, which maps every singular value towards 1, amplifies the fp32
  rounding differences of differently laid-out matmuls, and a one-ulp gradient alike: the
  floor's largest Muon difference is 3.5-4.3e-6 (dense) and 2.4-2.7e-5 (experts: the router),
  ours 0.12-1.08 times it. AdamW params: <= 1.2e-7, 0.35-0.90 times the floor's. Verdict per
  routing class: the largest difference at most ``FLOOR_FACTOR`` (10) times the floor's largest
  plus 4 fp32 ulps; each step's grad norm (the same gradients summed in another order: <= 2.9e-7)
  within ``FLOOR_FACTOR`` times the floor's envelope (the fp32 norm against the fp64 one, 0 to
  2.6e-7) plus 4 ulps. A 1% larger lr moves Muon and AdamW params by 9.5e-3 and 1.0e-2 (35 to
  220 times the bound), whole-matrix NS where blockwise is due by 0.27-0.48, a TP-replicated
  LayerNorm counted twice in the grad norm by 5e-2 or more.
- TP x DP2 against TP x DP1: the two runs reduce gradients in different orders (two half-batch
  backwards and a DP reduce-scatter against one whole-batch backward), ~1e-7 relative; losses
  then agree to 5e-7 and grad norms to 1.3e-6 over 3 steps, and Muon params to <= 4.6e-5 (the
  router weight and attention matrices, where NS amplifies most; dense distributed's
  ``linear_qkv`` 4.6e-5 against a floor of 6.4e-6, 0.72 of its bound: the nearest any verdict
  here comes to it). **Floor-judged**
  (tests/run_comparison.py): against TP x DP1 again with every weight one ulp up before the first
  step (``dp1_floor``, one more 2-rank launch): each step's loss and grad norm within
  ``FLOOR_FACTOR`` times the floor's envelope plus 4 fp32 ulps, the Muon params within
  ``FLOOR_FACTOR`` times the floor's largest Muon param difference plus 4 ulps.
- The split NS of ``layer_sharded`` (its Gram matrices summed over the block's ranks) against
  ``duplicated`` fed the same gradients and against the reference: 7e-7 to 9e-7, floor-judged
  against the reference's floor run (4.5-5.5e-6 on the split matrices).
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests import tp_parity
from tests.run_comparison import (
    FULL_PRECISION_GUARD,
    assert_largest_within_floor,
    assert_within_floor,
)
from tests.tp_parity import DENSE_TP2, DENSE_TP2_QK_CLIP, EXPERT_TP2, TP_MODES

pytestmark = pytest.mark.multirank  # every test here launches ranks

# Last: QK-clip on top (compared DP2 against DP1 only: the reference has no QK-clip).
CASES = [
    *[(DENSE_TP2, mode) for mode in TP_MODES],
    *[(EXPERT_TP2, mode) for mode in TP_MODES],
    (DENSE_TP2_QK_CLIP, "duplicated"),
]
CASE_IDS = [
    f"{'experts' if p.moe else 'dense'}-{mode}{'-qk-clip' if p.qk_clip_threshold else ''}"
    for p, mode in CASES
]
PARITY_CASES = range(len(CASES) - 1)


@pytest.fixture(scope="module")
def dp2() -> dict:
    """TP x DP2 on 4 ranks (every case), plus the group-mismatch errors."""
    return _by_case(run_on_ranks(tp_parity.train_ranks, 4, CASES, True, True, timeout=600))


@pytest.fixture(scope="module")
def dp1() -> dict:
    """TP x DP1 on 2 ranks (every case)."""
    return _by_case(run_on_ranks(tp_parity.train_ranks, 2, CASES, timeout=600))


@pytest.fixture(scope="module")
def dp1_floor() -> dict:
    """``dp1`` with every weight one ulp up before the first step: its floor."""
    return _by_case(run_on_ranks(tp_parity.train_ranks, 2, CASES, False, False, True, timeout=600))


def _by_case(per_rank: list[dict]) -> dict:
    return {
        "runs": [[rank["runs"][i] for rank in per_rank] for i in range(len(CASES))],
        "errors": per_rank[0]["errors"],
        "split": {
            mode: [rank["split"][mode] for rank in per_rank] for mode in per_rank[0]["split"]
        },
    }


def _relative(mine: torch.Tensor, expected: torch.Tensor) -> float:
    return float((mine - expected).double().norm() / expected.double().norm())


def _final(per_rank: list[dict], name: str) -> torch.Tensor:
    return tp_parity.assemble([result["final"] for result in per_rank], name)


@pytest.mark.parametrize("world", ["dp2", "dp1"])
@pytest.mark.parametrize("case", PARITY_CASES, ids=CASE_IDS[:-1])
def test_tensor_parallel_muon_matches_unsharded_tensor_parallel_muon(request, world, case):
    """Floor-judged against the reference's floor run, no launch (module docstring)."""
    parallelism, tp_mode = CASES[case]
    per_rank = request.getfixturevalue(world)["runs"][case]
    reference = tp_parity.reference_run(per_rank, tp_mode)
    floor = tp_parity.reference_run(per_rank, tp_mode, floor=True)
    routing = per_rank[0]["routing"]
    for kind in sorted(set(routing.values())):
        names = [n for n, routed in routing.items() if routed == kind]
        assert_largest_within_floor(
            f"{kind} params",
            {n: _relative(_final(per_rank, n), reference["params"][n]) for n in names},
            {n: _relative(floor["params"][n], reference["params"][n]) for n in names},
        )
    assert_within_floor(
        "grad norm",
        {step: stats["grad_norm"] for step, stats in enumerate(per_rank[0]["stats"], start=1)},
        dict(enumerate(reference["grad_norms"], start=1)),
        dict(enumerate(floor["grad_norms"], start=1)),
        guard=FULL_PRECISION_GUARD,
    )
    summary = per_rank[0]["summary"]
    assert all(f"tp_mode {tp_mode}" in line for line in summary if "Muon[" in line), summary
    marker = "Muon[expert]" if parallelism.moe else "Muon[dense]"
    tp_line = next(line for line in summary if marker in line)
    assert f"x {'expt_tp' if parallelism.moe else 'tp'} (2 ranks)" in tp_line, summary
    if world == "dp2":
        # Megatron-FSDP's uneven row shards: some rank holds no rows of some Muon matrix.
        assert any(result["empty_muon_shards"] for result in per_rank)
    print(f"\n{summary}")


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
def test_tensor_parallel_dp2_equals_dp1(dp2, dp1, dp1_floor, case):
    """Floor-judged (module docstring)."""
    two, one, floor = dp2["runs"][case], dp1["runs"][case], dp1_floor["runs"][case]
    for key in ("loss", "grad_norm"):
        got, expected, floor_of = (
            {step: s[key] for step, s in enumerate(run[0]["stats"], start=1)}
            for run in (two, one, floor)
        )
        assert_within_floor(
            f"DP2 vs DP1 {key}", got, expected, floor_of, guard=FULL_PRECISION_GUARD
        )
    for step, (a, b) in enumerate(zip(two[0]["stats"], one[0]["stats"], strict=True)):
        assert a["clipped_heads"] == b["clipped_heads"], step
    if CASES[case][0].qk_clip_threshold is not None:
        # QK-clip scaled query/key rows of heads in each TP partition's DP row shards.
        assert any(s["clipped_heads"] for s in two[0]["stats"]), two[0]["stats"]
    routing = two[0]["routing"]
    muons = [n for n, opt in routing.items() if opt == "muon"]
    assert_largest_within_floor(
        "DP2 vs DP1 Muon params",
        {n: _relative(_final(two, n), _final(one, n)) for n in muons},
        {n: _relative(_final(floor, n), _final(one, n)) for n in muons},
    )
    print(
        f"\nDP2 vs DP1 losses {[s['loss'] for s in two[0]['stats']]} "
        f"{[s['loss'] for s in one[0]['stats']]}"
    )


@pytest.mark.parametrize("world", ["dp2", "dp1"])
@pytest.mark.parametrize("parallelism", [DENSE_TP2, EXPERT_TP2], ids=["dense", "experts"])
def test_layer_sharded_is_duplicated_bitwise_with_its_ns_spread_over_the_dp_x_tp_grid(
    request, world, parallelism
):
    runs = request.getfixturevalue(world)["runs"]
    duplicated = runs[CASES.index((parallelism, "duplicated"))]
    layer_sharded = runs[CASES.index((parallelism, "layer_sharded"))]
    # The same unsplit matrices through the same NS: the same bits, not a tolerance.
    for name in duplicated[0]["final"]:
        assert torch.equal(_final(layer_sharded, name), _final(duplicated, name)), name
    for a, b in zip(layer_sharded[0]["stats"], duplicated[0]["stats"], strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    # Each matrix orthogonalized once over the grid, not once per TP rank: the busiest rank's NS
    # is about half of duplicated's at TP = 2 (the tiny GPT: 0.50 to 0.53, measured).
    busiest = max(r["ns_flops"] for r in layer_sharded)
    ratio = busiest / max(r["ns_flops"] for r in duplicated)
    print(f"\nlayer_sharded / duplicated NS FLOPs of the busiest rank: {ratio:.3f}")
    assert ratio <= 0.55, [(r["ns_flops"]) for r in layer_sharded + duplicated]


def test_layer_sharded_split_ns_is_duplicated_bitwise_unsplit_to_reduction_order_split(dp2):
    split, duplicated = dp2["split"]["layer_sharded"], dp2["split"]["duplicated"]
    # Above the threshold: fc1 split by rows, fc2 one TP partition per rank; QKV and proj whole.
    names = split[0]["split"]
    expected = ["linear_fc1"] * 2 + ["linear_fc2"] * 2  # of layers 0 and 1
    assert sorted(n.split(".")[-2] for n in names) == expected, names
    assert not duplicated[0]["split"]  # TP collectives: never split
    routing = split[0]["routing"]
    assert all(routing[name] == "muon" for name in names), routing
    for name in split[0]["final"]:
        # Fed the same gradients (duplicated replays layer_sharded's), each param's update depends
        # on its own gradients only: an unsplit matrix's is the same NS of the same matrix.
        if name not in names:
            assert torch.equal(_final(split, name), _final(duplicated, name)), name
    # Split NS sums its Gram matrices over the block's ranks: fp32 reduction order, which NS
    # amplifies (measured 7e-7 to 9e-7 against both): floor-judged (module docstring).
    reference = tp_parity.reference_run(split, "layer_sharded")
    floor = tp_parity.reference_run(split, "layer_sharded", floor=True)
    floors = {n: _relative(floor["params"][n], reference["params"][n]) for n in names}
    against = {
        "duplicated": {n: _final(duplicated, n) for n in names},
        "the reference": {n: reference["params"][n] for n in names},
    }
    for label, expected in against.items():
        differences = {n: _relative(_final(split, n), expected[n]) for n in names}
        assert_largest_within_floor(f"split NS vs {label}", differences, floors)
    for mine, theirs in zip(split[0]["stats"], duplicated[0]["stats"], strict=True):
        assert mine["grad_norm"] == theirs["grad_norm"]  # the same gradients


def test_process_groups_that_do_not_match_the_dtensors_are_refused_at_build(dp2):
    # Rank 0 of TP = 2 x DP = 2: dp_cp = ranks [0, 2], tp = ranks [0, 1].
    errors = dp2["errors"]
    assert (
        "mesh axis 1 ('tp') over ranks [0, 1], all in the data-parallel group [0, 1, 2, 3]"
        in (errors["dp_cp is the world"])
    )
    assert "is that group the one the model was wrapped with?" in errors["dp_cp is the world"]
    assert (
        "is split over tensor-parallel ranks [0, 1], but tp_mode='duplicated' would run its TP "
        "collectives over pg_collection.tp = ranks [0, 2]" in errors["tp is dp_cp"]
    )
    for mode in ("duplicated", "layer_sharded"):
        error = errors[f"qkv partition_dim 1, {mode}"]
        assert "along dim 0, but its partition_dim is 1" in error, error
        assert f"tp_mode={mode!r} joins the TP blocks along partition_dim" in error, error
        # Named by the factory: position and name in the Muon optimizer's params.
        assert "layers.0.self_attention.linear_qkv.weight) of shape (128, 64)" in error, error
