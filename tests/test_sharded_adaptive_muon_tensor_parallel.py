"""ShardedAdaptiveMuon at TP = 2 x DP = 2 equals megatron-core's TensorParallelAdaptiveMuon (fixed).

megatron-core's ``TensorParallelAdaptiveMuon`` (``integrations.adaptive_muon_fix``) steps each TP
rank's partition as a matrix of its own: the second moment (adamuon, normuon, namo), its state and
Muon's scale are the partition's (``optimizers/moment2_partitions.py``). The reference runs on each
rank: the stock class on the TP-local, DP-full matrices, over the TP group, the tp_mode matching
ours (layer_sharded: duplicated). Ours: the same matrices as Megatron-FSDP's DTensors, mesh
``(dp_cp, tp)``, placements ``(Shard(0), Shard(partition_dim))`` (a TP-duplicated one:
``Replicate()``), uneven and empty row shards. Shapes where the partition's longer side differs
from the unsplit matrix's (normuon's row/column choice is the partition's).

One launch of 4 ranks runs every method x tp_mode (owner mode; distributed in gather mode, as
``tests/tp_parity.py``), two steps with fresh grads, fp32 with highest matmul precision. Params,
momentum and this rank's partition of the second moment: relative error (Frobenius, per matrix)
<= ``TOLERANCE`` (1e-6, the fp32 reduction-order floor of docs/exactness.md: the momentum's norms
and NS's matmuls over rows gathered from two ranks round differently). normuon's and namo's
state (every partition's, stacked along dim 0) is bitwise the same on all 4 ranks, and bitwise
again after a DCP save (one copy kept) and a load into a fresh optimizer's created state.
layer_sharded's weights are bitwise duplicated's (normuon's partitions are the very views
duplicated's ``newton_schulz_tp`` takes: the same reduction order).
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests.muon_reference import MUON_KWARGS, TOLERANCE, full_tensor
from tests.row_split_parity import position_rows, relative_error

pytestmark = pytest.mark.multirank

METHODS = ("adamuon", "normuon", "namo")
# (tp_mode, fsdp mode)
TP_MODES = (
    ("blockwise", "owner"),
    ("duplicated", "owner"),
    ("layer_sharded", "owner"),
    ("distributed", "gather"),
)
# (unsplit shape, partition_dim (None: duplicated over TP), DP row split of the TP partition).
# (48, 32) split by rows: per row unsplit, per column in each (24, 32) partition; (32, 48) split
# by columns: the reverse; (40, 16): per row both.
SPECS = [
    ((48, 32), 0, [10, 14]),
    ((32, 48), 1, [32, 0]),
    ((40, 16), 0, [7, 13]),
    ((12, 32), None, [5, 7]),
]
KWARGS = {**{k: v for k, v in MUON_KWARGS.items() if k != "tp_mode"}, "extra_scale_factor": 1.5}
BETA2, EPS = 0.9, 1e-8
STEPS = 2


def _case(pgc, mesh, method: str, tp_mode: str, mode: str, path: str) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from megatron_muon.engine.layout import local_tensor
    from megatron_muon.engine.tensor_parallel import stock_tp_mode
    from megatron_muon.integrations.adaptive_muon_fix import TensorParallelAdaptiveMuonFixed
    from megatron_muon.optimizers.adaptive_muon import ShardedAdaptiveMuon
    from megatron_muon.optimizers.adaptive_muon_config import AdaptiveMuonConfig

    tp_rank, dp_rank = pgc.tp.rank(), pgc.dp_cp.rank()

    def partition(i: int, full: torch.Tensor) -> torch.Tensor:
        dim = SPECS[i][1]
        return full if dim is None else full.chunk(2, dim=dim)[tp_rank]

    def rows(i: int) -> slice:
        return position_rows(SPECS[i][2], dp_rank)

    def dtensor(i: int, full: torch.Tensor):
        dim = SPECS[i][1]
        placements = [Shard(0), Replicate() if dim is None else Shard(dim)]
        local = partition(i, full)[rows(i)].clone()
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
        )

    fulls = [full_tensor(shape, seed=i) for i, (shape, *_rest) in enumerate(SPECS)]
    params, reference_params = [], []
    for i, full in enumerate(fulls):
        param = torch.nn.Parameter(dtensor(i, full))
        # Where Megatron-FSDP says this rank's rows start in the partition (in elements).
        cols, start = partition(i, full).shape[1], rows(i).start
        param.megatron_fsdp_slice = slice(start * cols, rows(i).stop * cols)
        reference = torch.nn.Parameter(partition(i, full).clone())
        if SPECS[i][1] is not None:
            for p in (param, reference):
                p.partition_dim = SPECS[i][1]
                p.tensor_model_parallel = True
        params.append(param)
        reference_params.append(reference)
    config = AdaptiveMuonConfig(moment2_method=method, beta2=BETA2, eps=EPS)

    def build(params: list[torch.nn.Parameter]) -> ShardedAdaptiveMuon:
        return ShardedAdaptiveMuon.from_keywords(
            params,
            adaptive=config,
            dp_group=pgc.dp_cp,
            pg_collection=pgc,
            mode=mode,
            tp_mode=tp_mode,
            **KWARGS,
        )

    optimizer = build(params)
    reference = TensorParallelAdaptiveMuonFixed(
        reference_params,
        pg_collection=pgc,
        tp_mode=stock_tp_mode(tp_mode),
        moment2_method=method,
        beta2=BETA2,
        eps=EPS,
        **KWARGS,
    )
    for step in range(STEPS):
        for i, ref in enumerate(reference_params):
            grad = full_tensor(fulls[i].shape, seed=1000 * step + i + 7)
            ref.grad = partition(i, grad).clone()
            params[i].grad = None if SPECS[i][2][dp_rank] == 0 else dtensor(i, grad)
        optimizer.step()
        reference.step()
    errors, states = {}, []
    for i, (p, ref) in enumerate(zip(params, reference_params, strict=True)):
        mine, theirs = optimizer.state[p], reference.state[ref]
        moment2 = mine["moment2_buffer"]
        if method == "adamuon":
            moment2_rows = local_tensor(moment2)
            expected_moment2 = theirs["moment2_buffer"][rows(i)]
        else:
            states.append(moment2.clone())
            count = 1 if SPECS[i][1] is None else 2
            moment2_rows = moment2.chunk(count)[0 if count == 1 else tp_rank]
            expected_moment2 = theirs["moment2_buffer"]
            if method == "normuon":  # (rows_p, 1) or (1, cols_p): the partition's own shape
                moment2_rows = moment2_rows.view_as(expected_moment2)
        for key, got, expected, full in (
            ("param", local_tensor(p.detach()), ref.detach()[rows(i)], ref.detach()),
            (
                "momentum",
                local_tensor(mine["momentum_buffer"]),
                theirs["momentum_buffer"][rows(i)],
                theirs["momentum_buffer"],
            ),
            ("moment2", moment2_rows, expected_moment2, theirs["moment2_buffer"]),
        ):
            assert got.shape == expected.shape, (key, i, got.shape, expected.shape)
            errors[f"{key} {i}"] = relative_error(got, expected, full)
    reloaded = _reload(optimizer, build, f"{path}/{method}-{tp_mode}") if states else []
    weights = [local_tensor(p.detach()).clone() for p in params]
    return {"errors": errors, "states": states, "reloaded": reloaded, "weights": weights}


def _reload(optimizer, build, path: str) -> list[torch.Tensor]:
    """normuon's / namo's plain per-partition states through a DCP save (one copy kept, as in
    Megatron's fsdp_dtensor checkpoints) and a load into a fresh optimizer's created state."""
    import torch.distributed.checkpoint as dcp

    from megatron_muon.checkpointing.optimizer_state import ensure_optimizer_state

    def moment2(opt) -> dict[str, torch.Tensor]:
        params = opt.param_groups[0]["params"]
        return {f"param{i}": opt.state[p]["moment2_buffer"] for i, p in enumerate(params)}

    dcp.save(moment2(optimizer), checkpoint_id=path)
    fresh = build(optimizer.param_groups[0]["params"])  # the same params, no state
    ensure_optimizer_state(fresh)
    loaded = moment2(fresh)
    dcp.load(loaded, checkpoint_id=path)
    return list(loaded.values())


def _run(rank: int, world_size: int, path: str) -> dict:
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch.distributed.device_mesh import DeviceMesh

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        # Megatron-FSDP's mesh: dp_cp = ranks {0, 2} / {1, 3}, tp = {0, 1} / {2, 3}.
        grid = torch.arange(world_size).view(2, 2)
        mesh = DeviceMesh("cpu", grid, mesh_dim_names=("dp_cp", "tp"))
        return {
            f"{method} {tp_mode} {mode}": _case(pgc, mesh, method, tp_mode, mode, path)
            for method in METHODS
            for tp_mode, mode in TP_MODES
        }
    finally:
        parallel_state.destroy_model_parallel()


def test_tp2_dp2_equals_megatron_cores_adaptive_muon_per_tp_partition(tmp_path) -> None:
    results = run_on_ranks(_run, 4, str(tmp_path))
    for rank, by_case in enumerate(results):
        for case, result in by_case.items():
            assert max(result["errors"].values()) <= TOLERANCE, (rank, case, result["errors"])
    for rank, by_case in enumerate(results):  # layer_sharded computes duplicated's update
        for method in METHODS:
            duplicated = by_case[f"{method} duplicated owner"]["weights"]
            layer_sharded = by_case[f"{method} layer_sharded owner"]["weights"]
            for a, b in zip(duplicated, layer_sharded, strict=True):
                assert torch.equal(a, b), (rank, method)
    for case, result in results[0].items():
        for rank in range(4):
            for a, b in zip(result["states"], results[rank][case]["reloaded"], strict=True):
                assert torch.equal(a, b), (case, rank, "reloaded")
        for rank in range(1, 4):
            for a, b in zip(result["states"], results[rank][case]["states"], strict=True):
                assert torch.equal(a, b), (case, rank)
