"""Muon on Megatron-FSDP with tensor parallelism: the DTensors megatron-core really builds.

``parallel_state.initialize_model_parallel`` with TP, megatron-core's ``FullyShardedDataParallel``
around the tiny GPTModel (QKV split over GQA query groups), ``build_muon_optimizer``, 3 steps
(``tests/tp_parity.py``): dense TP = 2, and experts with expert TP = 2 (``expt_tp``; MoE with
TP > 1 needs sequence parallelism, which the CPU-only local spec lacks). One launch trains every
case at TP x DP2 (4 ranks), one at TP x DP1 (2 ranks), for each tp_mode; ``layer_sharded`` is
also compared with ``duplicated`` bit for bit (the same NS of the same unsplit matrices). The
DP2 launch also runs ``layer_sharded`` with the NS of the MLP weights split over grid ranks
(``tp_parity.split_against_duplicated``).

Numerics (fp32, ``muon_fp32_matmul_prec="highest"``), measured on the pinned stack:

- Against megatron-core's ``TensorParallelMuon`` + AdamW on the unsplit weights, fed the run's own
  reduced gradients: AdamW params <= 1.1e-7 relative, Muon params <= 5.4e-6: the router weight
  (expert case) and ``linear_proj.weight``, 2-4e-6 in every tp_mode at DP2 and DP1 alike, already
  2.5e-6 after the first step and with clipping off. Their first gradients are nearly rank
  deficient (``linear_proj``: condition number 5e8-3e9, median singular value 140-165x below the
  largest), so Newton-Schulz, which maps every singular value towards 1, amplifies the fp32
  rounding differences of differently laid-out matmuls. Tolerance 1e-5, as in
  ``test_factory.py``. A wrong TP block order, scale or QKV split is off by O(0.1).
- TP x DP2 against TP x DP1: the two runs reduce gradients in different orders (two half-batch
  backwards and a DP reduce-scatter against one whole-batch backward), ~1e-7 relative; losses
  then agree to 5e-7 and grad norms to 1e-6 over 3 steps, and Muon params to <= 3.4e-5 (the
  router weight and attention matrices, where NS amplifies most). **Floor-judged**
  (tests/run_comparison.py): against TP x DP1 again with every weight one ulp up before the first
  step (``dp1_floor``, one more 2-rank launch): each step's loss and grad norm within
  ``FLOOR_FACTOR`` times the floor's envelope plus 4 fp32 ulps, the Muon params within
  ``FLOOR_FACTOR`` times the floor's largest Muon param difference.
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests import tp_parity
from tests.run_comparison import FLOOR_FACTOR, FULL_PRECISION_GUARD, assert_within_floor
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

MUON_TOLERANCE = 1e-5  # against the reference fed the same gradients
ADAMW_TOLERANCE = 1e-6


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
    parallelism, tp_mode = CASES[case]
    per_rank = request.getfixturevalue(world)["runs"][case]
    reference = tp_parity.reference_run(per_rank, tp_mode)
    routing = per_rank[0]["routing"]
    errors = {n: _relative(_final(per_rank, n), p) for n, p in reference["params"].items()}
    for name, error in errors.items():
        tolerance = MUON_TOLERANCE if routing[name] == "muon" else ADAMW_TOLERANCE
        assert error <= tolerance, f"{name} ({routing[name]}): relative error {error:.2e}"
    for step, (stats, norm) in enumerate(
        zip(per_rank[0]["stats"], reference["grad_norms"], strict=True)
    ):
        assert stats["grad_norm"] == pytest.approx(norm, rel=1e-6), step
    summary = per_rank[0]["summary"]
    assert all(f"tp_mode {tp_mode}" in line for line in summary if "Muon[" in line), summary
    marker = "Muon[expert]" if parallelism.moe else "Muon[dense]"
    tp_line = next(line for line in summary if marker in line)
    assert f"x {'expt_tp' if parallelism.moe else 'tp'} (2 ranks)" in tp_line, summary
    if world == "dp2":
        # Megatron-FSDP's uneven row shards: some rank holds no rows of some Muon matrix.
        assert any(result["empty_muon_shards"] for result in per_rank)
    worst = max((n for n in errors if routing[n] == "muon"), key=errors.get)
    print(f"\n{summary}\nlargest Muon deviation: {worst} {errors[worst]:.2e}")


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
    errors = {n: _relative(_final(two, n), _final(one, n)) for n in muons}
    floors = {n: _relative(_final(floor, n), _final(one, n)) for n in muons}
    worst, bound = max(errors, key=errors.get), FLOOR_FACTOR * max(floors.values())
    assert errors[worst] <= bound, (
        f"{worst}: relative difference {errors[worst]:.2e} > {FLOOR_FACTOR:g} x the floor "
        f"{max(floors.values()):.2e} (its own {floors[worst]:.2e})"
    )
    print(
        f"\nDP2 vs DP1 losses {[s['loss'] for s in two[0]['stats']]} "
        f"{[s['loss'] for s in one[0]['stats']]}; largest Muon difference {worst} "
        f"{errors[worst]:.2e}, the floor's largest {max(floors.values()):.2e}"
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
    reference = tp_parity.reference_run(split, "layer_sharded")
    routing = split[0]["routing"]
    for name in split[0]["final"]:
        mine = _final(split, name)
        # Fed the same gradients (duplicated replays layer_sharded's), each param's update depends
        # on its own gradients only: an unsplit matrix's is the same NS of the same matrix.
        if name not in names:
            assert torch.equal(mine, _final(duplicated, name)), name
            continue
        # Split NS sums its Gram matrices over the block's ranks: fp32 reduction order, which NS
        # amplifies (measured 7e-7 to 9e-7 against both), within the floor of the reference
        # comparisons above.
        assert _relative(mine, _final(duplicated, name)) <= MUON_TOLERANCE, name
        assert _relative(mine, reference["params"][name]) <= MUON_TOLERANCE, name
        assert routing[name] == "muon", name
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
