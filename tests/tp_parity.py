"""Tensor-parallel GPT training under Megatron-FSDP, and its single-process reference.

Ranks train the tiny GPTModel (``tests/gpt_parity.py``, GQA: 4 heads in 2 query groups, so the QKV
split is ``[32, 16, 16]`` rows per group) wrapped by megatron-core's ``FullyShardedDataParallel``
after ``parallel_state.initialize_model_parallel`` with tensor parallelism, so every param is the
DTensor Megatron-FSDP builds: mesh ``(dp_cp, tp)``, placements ``(Shard(0), Shard(partition_dim))``,
global shape of the unsplit weight. Each rank returns its local rows with where they sit in the
unsplit weight; ``assemble`` puts the weights back together in the test process.

The reference (``reference_run``, in the test process) is megatron-core's ``TensorParallelMuon`` (+
AdamW) on the unsplit fp32 weights, fed the sharded run's own reduced gradients step by step, so it
differs from the sharded run only in arithmetic order. Under tp_mode blockwise each TP rank
orthogonalizes its own block, so the reference orthogonalizes each of the ``tp`` blocks along
``partition_dim`` apart; under duplicated and distributed the whole matrix.

Experts with tensor parallelism: MoE with TP > 1 refuses to train without sequence parallelism,
which the local spec's torch LayerNorm does not support, so the expert case runs TP = 1 with expert
tensor parallelism 2 (``expt_tp``; ``expt_dp`` = world / 2): expert weights are
``(expt_dp, expt_tp)`` DTensors, dense ones 1-D over ``dp_cp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tests import gpt_parity
from tests.gpt_parity import Run
from tests.nudge import nudge_weights, one_ulp_up_

TP_MODES = ("blockwise", "duplicated", "distributed", "layer_sharded")
# The exchange: owner-compute for three modes, the gather reference for one.
FSDP_MODE = {
    "blockwise": "owner",
    "duplicated": "owner",
    "distributed": "gather",
    "layer_sharded": "owner",
}
NUM_STEPS = 3
NUM_QUERY_GROUPS = 2
QKV_SPLIT = [32, 16, 16]  # per query group: 2 query heads x 16, one key head, one value head
GLOBAL_BATCH_WORLD = 2  # gpt_parity.batch(step, 2): 8 sequences per step, for every world size


@dataclass(frozen=True)
class Parallelism:
    """A TP layout: dense tensor parallelism ``tp``, expert tensor parallelism ``expert_tp``."""

    tp: int
    expert_tp: int
    moe: bool
    qk_clip_threshold: float | None = None  # QK-clip (MuonClip, QKClipConfig) on top

    def config(self) -> dict:
        return dict(
            tensor_model_parallel_size=self.tp,
            expert_tensor_parallel_size=self.expert_tp,
            num_query_groups=NUM_QUERY_GROUPS,
        )


DENSE_TP2 = Parallelism(tp=2, expert_tp=2, moe=False)
EXPERT_TP2 = Parallelism(tp=1, expert_tp=2, moe=True)
# Among the tiny GPT's per-head max logits (tests/test_factory_qk_clip.py): some heads clipped.
DENSE_TP2_QK_CLIP = Parallelism(tp=2, expert_tp=2, moe=False, qk_clip_threshold=0.12)

# The split check (``split_against_duplicated``): the tiny GPT with a gated MLP of 512 (fc1
# (1024, 64), fc2 (64, 512) unsplit), whose NS FLOPs (5 quintic steps) are linear_fc1 86.5M,
# linear_fc2 44.6M, linear_qkv 13.1M, linear_proj 7.9M. A split threshold between them lets the
# plan split fc1 (by rows) and fc2 (a whole TP partition per rank) over 2 grid ranks each at
# TP 2 x DP 2, and keeps QKV and proj whole.
SPLIT_MODEL = dict(gated_linear_unit=True, ffn_hidden_size=512)
SPLIT_MIN_FLOPS = 30_000_000


# --------------------------------------------------------------------------------------------------
# ranks: Megatron-FSDP training with TP
# --------------------------------------------------------------------------------------------------


def train_ranks(
    rank: int,
    world_size: int,
    cases: list[tuple[Parallelism, str]],
    check_errors: bool = False,
    check_split: bool = False,
    nudge: bool = False,
) -> dict:
    """Trains each ``(parallelism, tp_mode)`` case in turn (harness rank body); ``nudge``: every
    weight one ulp up before the first step (a floor run, tests/run_comparison.py).

    Returns ``{"runs": [per case], "errors": {...}, "split": {...}}``; with ``check_errors``,
    ``errors`` holds the messages ``build_muon_optimizer`` raises for process groups that do not
    match the DTensors (dense TP = 2 layout); with ``check_split``, ``split`` holds
    ``split_against_duplicated``'s two runs.
    """
    from megatron.core import parallel_state

    out: dict = {"runs": [], "errors": {}, "split": {}}
    current = None
    try:
        for parallelism, tp_mode in cases:
            if (parallelism.tp, parallelism.expert_tp) != current:
                _init(parallelism)
                current = (parallelism.tp, parallelism.expert_tp)
            out["runs"].append(_train(parallelism, tp_mode, nudge=nudge))
        if check_errors or check_split:
            if current != (DENSE_TP2.tp, DENSE_TP2.expert_tp):
                _init(DENSE_TP2)
        if check_errors:
            out["errors"] = _group_mismatch_errors()
        if check_split:
            out["split"] = split_against_duplicated()
    finally:
        parallel_state.destroy_model_parallel()
    return out


def split_against_duplicated() -> dict:
    """``layer_sharded`` with NS split over grid ranks (``SPLIT_MODEL``, ``SPLIT_MIN_FLOPS``),
    then ``duplicated`` on the same model fed the first run's reduced gradients step by step, so
    that each param's update depends on its own gradients only (dense TP = 2 layout).

    Returns ``{"layer_sharded": run, "duplicated": run}`` (``_train``'s records).
    """
    split = _train(DENSE_TP2, "layer_sharded", model=SPLIT_MODEL, min_split_flops=SPLIT_MIN_FLOPS)
    replayed = _train(DENSE_TP2, "duplicated", model=SPLIT_MODEL, replay=split["grads"])
    return {"layer_sharded": split, "duplicated": replayed}


def _init(parallelism: Parallelism) -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallelism.tp,
        expert_tensor_parallel_size=parallelism.expert_tp,
    )


def _group_mismatch_errors() -> dict[str, str]:
    """What building Muon says when its groups do not match the DTensors (dense TP = 2)."""
    import copy

    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_muon import build_muon_optimizer

    model = gpt_parity.build_gpt(False, **DENSE_TP2.config())
    wrapped = gpt_parity.wrap(model, Run("mcore", "optim_grads_params"), dist.get_world_size())
    mpu = ProcessGroupCollection.use_mpu_process_groups()
    config = gpt_parity.optimizer_config(muon_tp_mode="duplicated")
    attempts = {"dp_cp is the world": ("dp_cp", dist.group.WORLD), "tp is dp_cp": ("tp", mpu.dp_cp)}
    errors = {}
    for label, (field, group) in attempts.items():
        pg_collection = copy.copy(mpu)
        setattr(pg_collection, field, group)
        try:
            build_muon_optimizer(config, [wrapped], pg_collection=pg_collection)
        except ValueError as error:
            errors[label] = str(error)
    qkv = next(
        p for n, p in wrapped.named_parameters() if n.endswith("0.self_attention.linear_qkv.weight")
    )
    qkv.partition_dim = 1
    for mode in ("duplicated", "layer_sharded"):
        try:
            build_muon_optimizer(gpt_parity.optimizer_config(muon_tp_mode=mode), [wrapped])
        except ValueError as error:
            errors[f"qkv partition_dim 1, {mode}"] = str(error)
    return errors


def _train(
    parallelism: Parallelism,
    tp_mode: str,
    *,
    model: dict | None = None,
    min_split_flops: int | None = None,
    replay: list[dict] | None = None,
    nudge: bool = False,
) -> dict:
    """``NUM_STEPS`` steps of the tiny GPT under ``parallelism`` and ``tp_mode``; ``model``:
    ``TransformerConfig`` overrides; ``min_split_flops``: ``MuonFsdpConfig``'s (None: default);
    ``replay``: each step's reduced gradients to step with instead of this run's own (another
    run's ``"grads"``, the same layout); ``nudge``: every weight's row shard one ulp up (toward
    +inf) before the first step."""
    from megatron.core import parallel_state

    from megatron_muon import MuonFsdpConfig, QKClipConfig, ShardedMuon, build_muon_optimizer

    gpt = gpt_parity.build_gpt(parallelism.moe, **parallelism.config(), **(model or {}))
    wrapped = gpt_parity.wrap(gpt, Run("mcore", "optim_grads_params"), dist.get_world_size())
    named = {gpt_parity._strip(n): p for n, p in wrapped.named_parameters()}
    split = {} if min_split_flops is None else {"min_split_flops": min_split_flops}
    optimizer = build_muon_optimizer(
        gpt_parity.optimizer_config(muon_tp_mode=tp_mode),
        [wrapped],
        fsdp_config=MuonFsdpConfig(mode=FSDP_MODE[tp_mode], **split),
        qk_clip=(
            QKClipConfig(threshold=parallelism.qk_clip_threshold)
            if parallelism.qk_clip_threshold is not None
            else None
        ),
        grads_already_synced=True,  # this loop calls finish_grad_sync, as Megatron-LM's does
    )
    fsdp = optimizer.fsdp_modules[0]
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    if nudge:
        nudge_weights([wrapped])
    initial = {n: _piece(p, p) for n, p in named.items()}
    grads, stats = [], []
    for step in range(NUM_STEPS):
        tokens, labels = gpt_parity.batch(step, GLOBAL_BATCH_WORLD)
        optimizer.zero_grad()
        loss = gpt_parity.loss_of(
            wrapped, tokens.chunk(dp_size)[dp_rank], labels.chunk(dp_size)[dp_rank]
        )
        loss.backward()
        fsdp.finish_grad_sync()
        if replay is not None:
            for name, piece in replay[step].items():
                named[name].grad.to_local().copy_(piece[-1])
        grads.append({n: _piece(p, p.grad) for n, p in named.items() if p.grad is not None})
        ok, grad_norm, _ = optimizer.step()
        assert ok
        mean_loss = loss.detach().reshape(1) / dp_size
        dist.all_reduce(mean_loss, group=parallel_state.get_data_parallel_group())
        clipped = optimizer.last_qk_clip.num_clipped_heads if optimizer.last_qk_clip else None
        stats.append(
            {"loss": float(mean_loss), "grad_norm": float(grad_norm), "clipped_heads": clipped}
        )
    routing = {gpt_parity._strip(r.name): r.optimizer for r in optimizer.routing}
    muons = [o for o in optimizer.chained_optimizers if isinstance(o.optimizer, ShardedMuon)]
    return {
        "split": _split_names(muons, named),
        # This rank's NS FLOPs in the last step (every Muon: dense and expert).
        "ns_flops": sum(o.optimizer.step_stats.ns_flops for o in muons),
        "initial": initial,
        "grads": grads,
        "final": {n: _piece(p, p) for n, p in named.items()},
        "routing": routing,
        "empty_muon_shards": [
            n for n, p in named.items() if routing[n] == "muon" and p.to_local().shape[0] == 0
        ],
        "summary": list(optimizer.summary_lines),
        "stats": stats,
    }


def _split_names(muons: list, named: dict[str, torch.Tensor]) -> list[str]:
    """Names of the params whose NS the Muon optimizers' plans split over ranks."""
    names = {id(p): n for n, p in named.items()}
    split = []
    for wrapper in muons:
        muon = wrapper.optimizer
        matrices = [p for g in muon.param_groups for p in g["params"] if p.ndim == 2]
        split += [names[id(matrices[i])] for i in muon.owner_plan().split_matrices()]
    return split


def _piece(param: torch.Tensor, tensor: torch.Tensor) -> tuple:
    """(TP index, TP size, partition dim, first row in the TP partition, local rows) of
    ``tensor`` (the param or its grad, laid out alike).

    Read from the param's DTensor as Megatron-FSDP builds it: the ``tp`` mesh axis (if any) with
    its ``Shard(partition_dim)`` placement; rows located by ``megatron_fsdp_slice``.
    """
    from torch.distributed.tensor import Shard

    local = tensor.detach().to_local().clone()
    mesh = param.device_mesh
    tp_index, tp_size, dim = 0, 1, None
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        axis = names.index("tp")
        placement = param.placements[axis]
        if isinstance(placement, Shard):
            tp_index, tp_size, dim = mesh.get_coordinate()[axis], mesh.size(axis), placement.dim
    row_numel = max(1, local.shape[1:].numel())
    start = param.megatron_fsdp_slice.start // row_numel
    return tp_index, tp_size, dim, start, local


def assemble(per_rank_pieces: list[dict], name: str) -> torch.Tensor:
    """The unsplit tensor ``name`` from every rank's pieces (TP partitions joined along dim)."""
    partitions: dict[int, dict[int, torch.Tensor]] = {}
    tp_size, dim = 1, None
    for pieces in per_rank_pieces:
        if name not in pieces:
            continue
        tp_index, tp_size, dim, start, local = pieces[name]
        if local.shape[0]:
            partitions.setdefault(tp_index, {})[start] = local
    blocks = [
        torch.cat([rows for _, rows in sorted(partitions[i].items())]) for i in range(tp_size)
    ]
    return blocks[0] if dim is None else torch.cat(blocks, dim=dim)


def partition(per_rank_pieces: list[dict], name: str) -> tuple[int, int | None]:
    """(TP size, partition dim) of ``name``."""
    _, tp_size, dim, _, _ = per_rank_pieces[0][name]
    return tp_size, dim


# --------------------------------------------------------------------------------------------------
# the reference: one process, the unsplit model, TensorParallelMuon on full tensors
# --------------------------------------------------------------------------------------------------


class BlockwiseMuon:
    """Builds megatron-core's ``TensorParallelMuon`` on unsplit weights that orthogonalizes each
    weight in ``blocks[name]`` blocks along ``dims[name]``, one by one: what each TP rank does
    under tp_mode blockwise. One block: the whole matrix (duplicated, distributed)."""

    @staticmethod
    def build(params: dict[str, torch.Tensor], blocks: dict[str, tuple[int, int | None]]):
        from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

        names = {id(p): n for n, p in params.items()}

        class Blockwise(TensorParallelMuon):
            def orthogonalize(self, p, grad, **kwargs):
                count, dim = blocks[names[id(p)]]
                if count == 1:
                    return super().orthogonalize(p, grad, **kwargs)
                parts = [super(Blockwise, self).orthogonalize(p, g) for g in grad.chunk(count, dim)]
                return torch.cat(parts, dim=dim)

        return Blockwise(
            list(params.values()),
            lr=gpt_parity.LR,
            momentum=gpt_parity.MOMENTUM,
            nesterov=True,
            weight_decay=gpt_parity.WEIGHT_DECAY,
            split_qkv=True,
            is_qkv_fn=lambda p: names[id(p)].endswith("linear_qkv.weight"),
            qkv_split_shapes=QKV_SPLIT,
            fp32_matmul_prec="highest",
            tp_mode="blockwise",
        )


def reference_run(per_rank: list[dict], tp_mode: str, *, floor: bool = False) -> dict:
    """The unsharded single-process reference, fed the sharded run's own reduced gradients.

    megatron-core's ``TensorParallelMuon`` (blockwise per TP block, or whole matrices) + AdamW
    (no weight decay on 1-D params) on the unsplit fp32 weights, routed by name as
    ``gpt_parity.Reference`` does, global-norm clipping by ``torch.nn.utils.clip_grad_norm_``.
    Fed the same gradients, it differs from the sharded run only in arithmetic order.

    ``floor``: the reference's floor run (tests/run_comparison.py): fed every gradient one ulp up
    (toward +inf), its global norm summed in fp64 (another reduction order of the same
    gradients, rounded to fp32 once) and clipping by that norm: the last bits of what each step
    is fed changed, as another layout's rounding changes them, grown by the same optimizer.

    Returns:
        ``{"params": {name: unsplit tensor}, "grad_norms": [per step]}``.
    """
    initial = [result["initial"] for result in per_rank]
    params = {n: torch.nn.Parameter(assemble(initial, n)) for n in per_rank[0]["initial"]}
    muon = {n: p for n, p in params.items() if gpt_parity.reference_routes_to_muon(n, p)}
    blocks = {n: partition(initial, n) if tp_mode == "blockwise" else (1, None) for n in muon}
    muon_optimizer = BlockwiseMuon.build(muon, blocks)
    others = [(n, p) for n, p in params.items() if n not in muon]
    adamw = torch.optim.AdamW(
        [
            {
                "params": [p for _, p in others if p.ndim >= 2],
                "weight_decay": gpt_parity.WEIGHT_DECAY,
            },
            {"params": [p for _, p in others if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=gpt_parity.LR,
        betas=gpt_parity.BETAS,
        eps=gpt_parity.EPS,
    )
    norms = []
    for step in range(NUM_STEPS):
        grads = [result["grads"][step] for result in per_rank]
        for name, param in params.items():
            param.grad = assemble(grads, name)
        norms.append(_clip(list(params.values()), floor=floor))
        muon_optimizer.step()
        adamw.step()
    return {"params": {n: p.detach() for n, p in params.items()}, "grad_norms": norms}


def _clip(params: list[torch.Tensor], *, floor: bool) -> float:
    """Clips the fp32 gradients of ``params`` (unsplit, one process) to ``gpt_parity.CLIP_GRAD``
    by their global norm, which it returns: ``torch.nn.utils.clip_grad_norm_``'s fp32 norm, or
    with ``floor`` (``reference_run``) every gradient one ulp up first and the norm summed in
    fp64."""
    if not floor:
        return float(torch.nn.utils.clip_grad_norm_(params, gpt_parity.CLIP_GRAD))
    grads = [p.grad for p in params if p.grad is not None]
    for grad in grads:
        one_ulp_up_(grad)
    norm = torch.nn.utils.get_total_norm([grad.double() for grad in grads]).float()
    torch.nn.utils.clip_grads_with_norm_(params, gpt_parity.CLIP_GRAD, norm)
    return float(norm)
