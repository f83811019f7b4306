"""ShardedMuon: Muon that is exact on Megatron-FSDP's data-parallel row shards.

Megatron-FSDP hands the optimizer each weight as a DTensor sharded by whole rows over the
data-parallel group (uneven, sometimes empty, ``grad is None`` where a rank holds no rows).
Momentum, weight decay and the parameter update are elementwise, so they stay on each rank's own
rows; only Newton-Schulz (NS) needs the full matrix. One step is:

1. every rank walks every param in the same order (a rank with no rows holds a zero grad), applies
   weight decay and the momentum update to its own rows;
2. the full matrices are brought together for NS over ``dp_group``:
   - ``mode="owner"`` (default): each matrix has one owner rank (largest NS cost first onto the
     least-loaded rank; ``planner.plan_owners``); one packed all_to_all per bucket brings the
     shards to owners, owners orthogonalize (same-shape matrices batched into one NS call), one
     packed all_to_all returns each holder its rows. NS work per rank ~ total / DP.
   - ``mode="gather"`` (reference): padded all_gather, NS of every matrix on every rank.
   3-D expert tensors ``(E, out, in)`` are sharded by whole experts, so each rank orthogonalizes
   its own experts (batched) with no communication;
3. each rank updates its own rows in place (placements and global shape untouched).

Orthogonalization semantics are megatron-core ``TensorParallelMuon``'s (scale modes, coefficient
types, NS steps, QKV split, tp_mode blockwise/duplicated/distributed). With tensor parallelism
Megatron-FSDP's param is a DTensor on a ``(dp_cp, tp)`` mesh (``layout.py``): the exchange runs
over ``dp_group``, the data-parallel ranks of one TP rank, on the TP-local matrix; under
duplicated/distributed the DP-full TP-local matrix then goes through
``TensorParallelMuon.orthogonalize`` itself, so its TP collectives run over ``pg_collection.tp``
(``expt_tp`` for experts) among the TP ranks that own the same matrix (the plan depends on shapes
only, which are the same on every TP rank); under blockwise each TP rank orthogonalizes its own
block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from emerging_optimizers import utils as eo_utils
from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import ParamsT

from megatron_muon.config import MuonConfig, MuonFsdpConfig
from megatron_muon.cost_model import split_bounds, split_dim_of_pieces, split_ns_flops
from megatron_muon.exchange import ExchangeStats, GatherExchange, OwnerExchange, WorkBlock
from megatron_muon.layout import (
    RowLayout,
    TensorParallelSplit,
    check_same_params,
    gather_row_layouts,
    group_ranks,
    local_tensor,
    mesh_axes,
)
from megatron_muon.newton_schulz import NSConfig, NSMethodT, ns_flops, orthogonalize_batch
from megatron_muon.options import FsdpModeT, GramHalfDtypeT, MuonScaleT, TpModeT
from megatron_muon.planner import OwnerPlan, plan_owners, plan_split_owners
from megatron_muon.split_newton_schulz import split_scaled_orthogonalize

__all__ = ["ShardedMuon", "StepStats"]


@dataclass(slots=True)
class StepStats:
    """What the last ``step()`` cost this rank: NS FLOPs, bytes moved, collectives entered."""

    ns_flops: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    num_collectives: int = 0
    peak_full_matrix_bytes: int = 0


@dataclass(slots=True)
class _StepPlan:
    """Everything about the params that does not change between steps (computed once)."""

    params: list[torch.Tensor]
    groups: list[dict]
    layouts: list[RowLayout]
    matrices: list[int]  # positions (in params) of 2-D params, exchanged for NS
    experts: list[int]  # positions of 3-D params, orthogonalized locally
    owner_plan: OwnerPlan
    buckets: list[list[int]]  # positions into ``matrices``
    dp_size: int
    work: list[list[WorkBlock]]  # per matrix: who computes which rectangle of it
    split_groups: dict[tuple[int, int], dist.ProcessGroup]
    exchanges: dict[tuple[int, ...], Any] = field(default_factory=dict)


def _tp_size(pg_collection: Any) -> int:
    group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    return dist.get_world_size(group) if group is not None else 1


class ShardedMuon(TensorParallelMuon):
    """Muon on data-parallel row-sharded params (Megatron-FSDP), exact and hang-free.

    Takes ``TensorParallelMuon``'s keywords with the same defaults, plus:

    Args:
        dp_group: process group the rows are sharded over: ``pg_collection.dp_cp`` for dense params,
            ``pg_collection.expt_dp`` for experts. ``None`` means the default (world) group.
        mode: ``"owner"`` (each full matrix orthogonalized once, by one owner rank) or
            ``"gather"`` (every rank gathers and orthogonalizes every matrix; a reference).
        bucket_size_bytes: bound on the fp32 bytes of full matrices exchanged at once (peak extra
            memory); ``None`` exchanges all matrices in one bucket.
        ns_method: ``"standard"`` NS or ``"gram"`` (Gram Newton-Schulz; ``newton_schulz.py``).
        custom_coefficient_sets: the ``(a, b, c)`` triples for ``coefficient_type="custom"``.
        gram_restarts, gram_half_dtype: Gram NS restarts and its half dtype under ``"medium"``
            precision (``NSConfig``; fp16 by default, which CPUs emulate slowly: use bfloat16
            there).
        offload_momentum: keep momentum in (pinned, on GPU machines) CPU memory between steps; it
            is brought back to the param's device for the step. Results are bitwise unchanged.
            Momentum stays resident from ``state_dict()`` until the end of the next step.
        min_split_flops: a matrix whose NS costs at least this many FLOPs may have its NS split
            over a small block of ranks when one owner per matrix cannot balance the load
            (``planner.plan_split_owners``); ``0`` allows splitting any matrix.

    Params: DTensors with ``Shard(0)`` or ``Replicate`` placements on their data-parallel mesh axes
    (1-D ``dp_group`` mesh, or the two axes of an HSDP mesh), plus, under tensor parallelism,
    ``Shard(partition_dim)`` on a tensor-parallel axis (Megatron-FSDP's ``(dp_cp, tp)`` mesh, global
    shape of the unsplit weight); or plain tensors (replicated over ``dp_group``); 2-D
    ``(out, in)`` matrices or 3-D ``(E, out, in)`` expert tensors (orthogonalized per expert).
    State (``momentum_buffer``, like the param) exists for every param on every rank from
    construction on, so checkpoint keys are the same on every rank.

    Raises:
        ValueError: bad keywords; a param that is not a matrix; a DTensor whose data-parallel mesh
            axes are not ``dp_group``, or, with tp_mode duplicated/distributed, whose
            tensor-parallel axis is not ``pg_collection.tp`` (``expt_tp``) or does not split
            ``partition_dim``.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-4,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.01,
        use_decoupled_weight_decay: bool = True,
        split_qkv: bool = False,
        is_qkv_fn: Callable[[torch.Tensor], bool] | None = None,
        qkv_split_shapes: list[int] | None = None,
        fp32_matmul_prec: str = "medium",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        scale_mode: MuonScaleT = "spectral",
        extra_scale_factor: float = 1.0,
        pg_collection: Any = None,
        tp_mode: TpModeT = "duplicated",
        *,
        dp_group: dist.ProcessGroup | None = None,
        mode: FsdpModeT = "owner",
        bucket_size_bytes: int | None = None,
        ns_method: NSMethodT = "standard",
        custom_coefficient_sets: list[tuple[float, float, float]] | None = None,
        gram_restarts: tuple[int, ...] | None = None,
        gram_half_dtype: GramHalfDtypeT = "float16",
        offload_momentum: bool = False,
        min_split_flops: int = 10**11,
    ) -> None:
        # Refused at construction: values that would step uphill or fail only at the first step.
        # The Muon and megatron-muon keywords are checked by their configs (config.py).
        if not lr >= 0.0:  # also NaN
            raise ValueError(f"lr must be >= 0, got {lr}")
        MuonConfig(
            momentum=momentum,
            split_qkv=split_qkv,
            nesterov=nesterov,
            scale_mode=scale_mode,
            fp32_matmul_prec=fp32_matmul_prec,
            coefficient_type=coefficient_type,
            num_ns_steps=num_ns_steps,
            tp_mode=tp_mode,
            extra_scale_factor=extra_scale_factor,
        )
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        MuonFsdpConfig(
            mode=mode,
            bucket_size_bytes=bucket_size_bytes,
            ns_method=ns_method,
            gram_half_dtype=gram_half_dtype,
            gram_restarts=gram_restarts,
            offload_momentum=offload_momentum,
        )
        if split_qkv and is_qkv_fn is None:
            raise ValueError("split_qkv=True needs is_qkv_fn to tell which params are QKV weights")
        super().__init__(
            params,
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            use_decoupled_weight_decay=use_decoupled_weight_decay,
            split_qkv=split_qkv,
            is_qkv_fn=is_qkv_fn,
            qkv_split_shapes=qkv_split_shapes,
            fp32_matmul_prec=fp32_matmul_prec,
            coefficient_type=coefficient_type,
            num_ns_steps=num_ns_steps,
            scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor,
            pg_collection=pg_collection,
            tp_mode=tp_mode,
        )
        self.ns_config = NSConfig(
            num_ns_steps=num_ns_steps,
            coefficient_type=coefficient_type,  # type: ignore[arg-type]
            scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor,
            ns_method=ns_method,
            custom_coefficient_sets=(
                tuple(tuple(c) for c in custom_coefficient_sets)  # type: ignore[misc]
                if custom_coefficient_sets is not None
                else None
            ),
            gram_restarts=gram_restarts,
            gram_half_dtype=gram_half_dtype,
        )
        if not self.ns_config.is_tensor_parallel_muons and (
            tp_mode != "blockwise" and _tp_size(pg_collection) > 1
        ):
            raise ValueError(
                f"ns_method={ns_method!r} / custom coefficients run in megatron_muon's own NS; "
                f"tp_mode={tp_mode!r} with tensor parallelism runs TensorParallelMuon's standard "
                "NS across TP ranks. Use tp_mode='blockwise' or the standard method."
            )
        self.dp_group = dp_group
        self.offload_momentum = offload_momentum
        self.min_split_flops = min_split_flops
        self._offloaded: dict[torch.Tensor, torch.Tensor] = {}
        self.mode: FsdpModeT = mode
        self.bucket_size_bytes = bucket_size_bytes
        self.step_stats = StepStats()
        self._plan: _StepPlan | None = None
        self._check_meshes()
        for group in self.param_groups:
            self._init_group(group, skip_non_grad_params=False)

    def _check_meshes(self) -> None:
        """Each DTensor param's mesh matches ``dp_group`` (its rows) and, where tensor parallelism
        splits it and ``tp_mode`` communicates, the TP group of ``TensorParallelMuon``. Metadata
        only: no collective."""
        dp_ranks = sorted(group_ranks(self.dp_group))
        for index, param in enumerate(self._all_params()):
            if not isinstance(param, DTensor):
                continue
            axes = mesh_axes(param, dp_ranks)
            where = (
                f"param {index} of shape {tuple(param.shape)} (placements "
                f"{tuple(param.placements)})"
            )
            if sorted(axes.data_parallel_ranks) != dp_ranks:
                raise ValueError(
                    f"{where} has its rows on ranks {sorted(axes.data_parallel_ranks)}, but Muon "
                    f"would exchange them over dp_group = ranks {dp_ranks}; pass the group the "
                    "model was wrapped with (pg_collection.dp_cp, or expt_dp for experts)"
                )
            for split in axes.tensor_parallel:
                self._check_tensor_parallel_split(param, split, where)

    def _check_tensor_parallel_split(
        self, param: torch.Tensor, split: TensorParallelSplit, where: str
    ) -> None:
        """Under tp_mode duplicated/distributed, ``TensorParallelMuon.orthogonalize`` joins the
        TP blocks along ``param.partition_dim`` over ``pg_collection.tp`` (``expt_tp``): both must
        be what the DTensor's tensor-parallel axis says. Blockwise needs neither."""
        if self.tp_mode == "blockwise":
            return
        if param.ndim != 2:
            raise ValueError(
                f"{where} is split over tensor-parallel ranks {list(split.ranks)}: tp_mode="
                f"{self.tp_mode!r} on 3-D expert tensors is not supported; use 'blockwise'"
            )
        partition_dim = getattr(param, "partition_dim", None)
        if partition_dim != split.dim:
            raise ValueError(
                f"{where} is split over tensor-parallel ranks {list(split.ranks)} along dim "
                f"{split.dim}, but its partition_dim is {partition_dim}: tp_mode="
                f"{self.tp_mode!r} joins the TP blocks along partition_dim"
            )
        group = self._tp_group(param)
        ranks = sorted(group_ranks(group)) if group is not None else None
        if ranks != sorted(split.ranks):
            name = "expt_tp" if getattr(param, "expert_tp", False) else "tp"
            raise ValueError(
                f"{where} is split over tensor-parallel ranks {list(split.ranks)}, but tp_mode="
                f"{self.tp_mode!r} would run its TP collectives over pg_collection.{name} = "
                f"ranks {ranks}; pass the pg_collection the model was wrapped with"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group`` (also used by the constructor), refusing params that
        ShardedMuon cannot orthogonalize; nothing is added when one is refused.

        The new params' state is created by the next ``step()`` (locally, without a collective);
        that step is collective over ``dp_group`` as always, so every rank adds the same group.

        Raises:
            ValueError: a param that is not 2-D or 3-D, or has a complex dtype (Newton-Schulz
                runs on real matrices; a cast would drop the imaginary part).
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        first = sum(len(g["params"]) for g in self.param_groups[:-1])
        names = group.get("param_names") or [None] * len(group["params"])
        for index, (param, name) in enumerate(zip(group["params"], names, strict=True)):
            label = f"param {first + index}" + (f" ({name})" if name else "")
            problem = None
            if param.is_complex():
                problem = f"has complex dtype {param.dtype}; Newton-Schulz needs a real matrix"
            elif param.ndim not in (2, 3):
                problem = (
                    f"has shape {tuple(param.shape)} ({param.ndim}-D); ShardedMuon "
                    "orthogonalizes matrices: route it to the scalar optimizer"
                )
            if problem is not None:
                self.param_groups.pop()
                raise ValueError(f"ShardedMuon: {label} {problem}")

    # ----------------------------------------------------------------------------------------------
    # step: local momentum -> NS on full matrices -> local update
    # ----------------------------------------------------------------------------------------------

    @torch.no_grad()  # type: ignore[misc]
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """One Muon step. Collective over ``dp_group``: every rank must call it."""
        if closure is not None:
            raise ValueError("closure is not supported")
        plan = self._step_plan()
        self.step_stats = StepStats()
        # State missing for a param added by add_param_group, or loaded from an optimizer that
        # never stepped it (TensorParallelMuon creates state lazily): zeros, on each rank alone.
        for group in self.param_groups:
            self._init_group(group, skip_non_grad_params=False)
        active = self._params_with_grad_anywhere(plan)
        self._bring_momentum_back()
        inputs: list[torch.Tensor | None] = [None] * len(plan.params)
        for position, (param, group) in enumerate(zip(plan.params, plan.groups, strict=True)):
            if active[position]:
                inputs[position] = self._momentum_update(param, group)
        with eo_utils.fp32_matmul_precision(self.fp32_matmul_prec):
            updates = self._orthogonalize_all(plan, inputs)
        for position, update in enumerate(updates):
            if update is None:
                continue
            param, group = plan.params[position], plan.groups[position]
            local = local_tensor(param)
            update = update.view_as(local).to(local.dtype)
            self.pre_weight_update_fn_inplace(local, update)
            local.add_(update, alpha=-group["lr"])
            self.post_weight_update_fn_inplace(local)
        if self.offload_momentum:
            self._offload_momentum()
        return None

    def _momentum_update(self, param: torch.Tensor, group: dict) -> torch.Tensor:
        """Weight decay and momentum on this rank's rows; returns the NS input rows."""
        local = local_tensor(param)
        grad = local_tensor(param.grad) if param.grad is not None else torch.zeros_like(local)
        self._apply_weight_decay_inplace(local, grad, group["lr"], group["weight_decay"])
        buffer = local_tensor(self.state[param]["momentum_buffer"])
        buffer.lerp_(grad, 1 - group["momentum"])
        if self.nesterov:
            return grad.lerp(buffer, group["momentum"])
        return buffer

    def _params_with_grad_anywhere(self, plan: _StepPlan) -> list[bool]:
        """Which params have a grad on some rank of ``dp_group`` (one small all_reduce).

        A rank holding zero rows has ``grad is None`` yet must take part; a param with no grad on
        any rank is skipped everywhere, as ``TensorParallelMuon`` skips it.
        """
        flags = torch.tensor([p.grad is not None for p in plan.params], dtype=torch.int32)
        if plan.dp_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.dp_group)
            self.step_stats.num_collectives += 1
        return [bool(f) for f in flags.tolist()]

    # ----------------------------------------------------------------------------------------------
    # momentum offload
    # ----------------------------------------------------------------------------------------------

    def _offload_momentum(self) -> None:
        """Copies each momentum's local rows to host memory and frees the device storage.

        The tensor objects in ``self.state`` stay (checkpoint keys, DTensor placements and global
        shape unchanged); only their storage is released until ``_bring_momentum_back``.
        """
        pin = torch.cuda.is_available()
        for param in self._all_params():
            local = local_tensor(self.state[param]["momentum_buffer"])
            host = self._offloaded.get(local)
            if host is None:
                host = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
                self._offloaded[local] = host
            host.copy_(local, non_blocking=pin)
        if pin:
            torch.cuda.current_stream().synchronize()
        for local in self._offloaded:
            local.untyped_storage().resize_(0)

    def bring_momentum_back(self) -> None:
        """Makes offloaded momentum resident again (before anything reads or writes ``state``
        directly, as ``megatron_muon.checkpointing`` does); the next step offloads it again."""
        self._bring_momentum_back()

    def _bring_momentum_back(self) -> None:
        """Restores offloaded momentum to the device (a no-op when nothing is offloaded)."""
        for local, host in self._offloaded.items():
            storage = local.untyped_storage()
            if storage.size() == 0:
                storage.resize_(host.numel() * host.element_size())
                local.copy_(host, non_blocking=True)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state with every momentum resident (offloaded momentum brought back)."""
        self._bring_momentum_back()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads state; offload bookkeeping restarts from the loaded (resident) tensors."""
        self._bring_momentum_back()
        self._offloaded.clear()
        super().load_state_dict(state_dict)

    # ----------------------------------------------------------------------------------------------
    # orthogonalization
    # ----------------------------------------------------------------------------------------------

    def _orthogonalize_all(
        self, plan: _StepPlan, inputs: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Orthogonalized update rows of every active param, ``(local rows, *row_shape)`` fp32."""
        updates: list[torch.Tensor | None] = [None] * len(plan.params)
        expert_positions = [p for p in plan.experts if inputs[p] is not None]
        if expert_positions:
            # Whole experts per rank: NS of the local experts, no communication.
            jobs = [e for p in expert_positions for e in inputs[p].float().unbind(0)]  # type: ignore[union-attr]
            results = iter(self._run_ns_jobs(jobs))
            for p in expert_positions:
                count = inputs[p].shape[0]  # type: ignore[union-attr]
                local = [next(results) for _ in range(count)]
                shape = inputs[p].shape  # type: ignore[union-attr]
                updates[p] = (
                    torch.stack(local) if local else torch.empty(shape, device=inputs[p].device)  # type: ignore[union-attr]
                )
        stats = ExchangeStats()
        buckets = []  # (active bucket positions, param positions, local rows), non-empty only
        for bucket in plan.buckets:
            active = tuple(m for m in bucket if inputs[plan.matrices[m]] is not None)
            if active:
                positions = [plan.matrices[m] for m in active]
                buckets.append((active, positions, [inputs[p].float() for p in positions]))  # type: ignore[union-attr]
        if plan.dp_size == 1:
            # Every rank holds every row: no exchange, NS on the local (full) matrices.
            for _active, positions, local_rows in buckets:
                self._note_peak(local_rows)
                for p, rows in zip(
                    positions, self._orthogonalize_full(positions, local_rows), strict=True
                ):
                    updates[p] = rows
        elif self.mode == "gather":
            for active, positions, local_rows in buckets:
                results = self._gather_bucket(plan, active, positions, local_rows, stats)
                for p, rows in zip(positions, results, strict=True):
                    updates[p] = rows
        else:
            self._owner_pipeline(plan, buckets, updates, stats)
        self.step_stats.bytes_sent += stats.bytes_sent
        self.step_stats.bytes_received += stats.bytes_received
        self.step_stats.num_collectives += stats.num_collectives
        return updates

    def _owner_pipeline(self, plan, buckets, updates, stats) -> None:
        """Owner-compute over buckets, communication overlapped with NS.

        While the owners orthogonalize bucket ``k``, bucket ``k + 1``'s shards are already on their
        way (async all_to_all) and bucket ``k - 1``'s results on their way back, so at most two
        buckets' full matrices are alive at once.
        """
        exchanges = [
            self._owner_exchange(plan, active, positions, rows[0].device)
            for active, positions, rows in buckets
        ]
        if not exchanges:
            return
        incoming = exchanges[0].start_gather_to_owners(buckets[0][2], stats)
        outgoing = []
        for k, exchange in enumerate(exchanges):
            blocks = exchange.finish(incoming)
            if k + 1 < len(exchanges):
                incoming = exchanges[k + 1].start_gather_to_owners(buckets[k + 1][2], stats)
            self._note_peak(blocks.values())
            active, positions = buckets[k][0], buckets[k][1]
            results = self._orthogonalize_blocks(plan, active, positions, blocks)
            outgoing.append(exchange.start_scatter_from_owners(results, stats))
        for k, (exchange, pending) in enumerate(zip(exchanges, outgoing, strict=True)):
            for p, rows in zip(buckets[k][1], exchange.finish(pending), strict=True):
                updates[p] = rows

    def _orthogonalize_blocks(self, plan, active, positions, blocks) -> dict:
        """Results of this rank's work blocks: whole matrices batched, split ones in order."""
        whole = [key for key in sorted(blocks) if plan.owner_plan.split_size(active[key[0]]) == 1]
        results = dict(
            zip(
                whole,
                self._orthogonalize_full(
                    [positions[m] for m, _ in whole], [blocks[key] for key in whole]
                ),
                strict=True,
            )
        )
        for key in sorted(set(blocks) - set(whole)):
            m, k = key
            matrix = active[m]
            group = plan.split_groups[
                (plan.owner_plan.owners[matrix], plan.owner_plan.split_size(matrix))
            ]
            results[key] = self._split_orthogonalize(
                plan.params[positions[m]], plan.layouts[positions[m]], blocks[key], group, k
            )
        return results

    def _split_orthogonalize(
        self,
        param: torch.Tensor,
        layout: RowLayout,
        block: torch.Tensor,
        group: dist.ProcessGroup,
        part: int,
    ) -> torch.Tensor:
        """This rank's block of a matrix whose NS is split over ``group`` (Q, K, V apart).

        Collective over ``group``. ``block`` holds rows (tall matrix) or columns (wide matrix, or
        a QKV param split by columns) ``split_bounds(long side, g)[part]`` of the full matrix.
        """
        rows, cols = layout.num_rows, layout.row_shape[0]
        size = dist.get_world_size(group)
        pieces = self._ns_pieces(param, layout)
        for piece_rows, piece_cols in pieces:
            self.step_stats.ns_flops += split_ns_flops(
                piece_rows, piece_cols, self.ns_config.num_ns_steps, size, part
            )
        if len(pieces) == 1:
            return split_scaled_orthogonalize(block, (rows, cols), group, self.ns_config)
        shapes = self._qkv_split_shapes(param)
        groups = rows // sum(shapes)  # type: ignore[arg-type]
        local_cols = block.shape[1]
        split = torch.split(block.view(groups, sum(shapes), local_cols), shapes, dim=1)  # type: ignore[arg-type]
        done = [
            split_scaled_orthogonalize(
                piece.reshape(-1, local_cols), (piece_rows, cols), group, self.ns_config
            ).view(groups, -1, local_cols)
            for piece, (piece_rows, _) in zip(split, pieces, strict=True)
        ]
        return torch.cat(done, dim=1).view(rows, local_cols)

    def _owner_exchange(self, plan, active, positions, device) -> OwnerExchange:
        exchange = plan.exchanges.get(active)
        if exchange is None:
            exchange = OwnerExchange(
                [plan.layouts[p] for p in positions],
                [plan.work[m] for m in active],
                list(active),
                dist.get_rank(self.dp_group),
                self.dp_group,
                device,
            )
            plan.exchanges[active] = exchange
        return exchange

    def _gather_bucket(self, plan, active, positions, local_rows, stats) -> list[torch.Tensor]:
        exchange = plan.exchanges.get(active)
        if exchange is None:
            exchange = GatherExchange(
                [plan.layouts[p] for p in positions],
                dist.get_rank(self.dp_group),
                self.dp_group,
                local_rows[0].device,
            )
            plan.exchanges[active] = exchange
        full = exchange.gather(local_rows, stats)
        self._note_peak(full)
        results = self._orthogonalize_full(positions, full)
        return [exchange.local_rows_of(r, m).clone() for m, r in enumerate(results)]

    def _note_peak(self, matrices) -> None:
        total = sum(4 * m.numel() for m in matrices)
        self.step_stats.peak_full_matrix_bytes = max(self.step_stats.peak_full_matrix_bytes, total)

    def _orthogonalize_full(
        self, positions: list[int], matrices: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Orthogonalizes full (DP-gathered, TP-local) 2-D matrices with TensorParallelMuon's rules.

        Matrices with a tensor-parallel partition (tp_mode duplicated/distributed, TP size > 1) go
        through ``TensorParallelMuon.orthogonalize`` one by one (its TP collectives); all others are
        cut into NS jobs (Q, K and V apart under QKV split) and same-shape jobs share one NS call.
        """
        params = [self._plan.params[p] for p in positions]  # type: ignore[union-attr]
        results: list[torch.Tensor | None] = [None] * len(matrices)
        job_lists: list[list[torch.Tensor] | None] = [None] * len(matrices)
        for i, (param, matrix) in enumerate(zip(params, matrices, strict=True)):
            if self._needs_tp_collectives(param):
                results[i] = self.orthogonalize(param, matrix)
                tp_size = dist.get_world_size(self._tp_group(param))
                self.step_stats.ns_flops += ns_flops(
                    matrix.shape[0], matrix.shape[1], self.ns_config.num_ns_steps
                ) * (tp_size if self.tp_mode == "duplicated" else 1)
            else:
                job_lists[i] = self._ns_jobs(param, matrix)
        flat_jobs = [job for jobs in job_lists if jobs is not None for job in jobs]
        flat_results = iter(self._run_ns_jobs(flat_jobs))
        for i, jobs in enumerate(job_lists):
            if jobs is None:
                continue
            done = [next(flat_results) for _ in jobs]
            results[i] = self._assemble(params[i], matrices[i], done)
        return results  # type: ignore[return-value]

    def _run_ns_jobs(self, jobs: list[torch.Tensor]) -> list[torch.Tensor]:
        """NS + scale of each 2-D job, same-shape jobs batched into one call; order kept."""
        by_shape: dict[tuple[int, int], list[int]] = {}
        for index, job in enumerate(jobs):
            by_shape.setdefault(tuple(job.shape), []).append(index)
        results: list[torch.Tensor | None] = [None] * len(jobs)
        for (rows, cols), indices in by_shape.items():
            outputs = orthogonalize_batch([jobs[i] for i in indices], self.ns_config)
            self.step_stats.ns_flops += len(indices) * self.ns_config.flops(rows, cols)
            for i, output in zip(indices, outputs, strict=True):
                results[i] = output
        return results  # type: ignore[return-value]

    def _qkv_split_shapes(self, param: torch.Tensor) -> list[int] | None:
        if not (self.split_qkv and self.is_qkv_fn(param)):  # type: ignore[misc]
            return None
        shapes = getattr(param, "qkv_split_shapes", None) or self.qkv_split_shapes
        if shapes is None:
            raise RuntimeError("Muon QKV split requested but qkv_split_shapes is not set")
        return list(shapes)

    def _ns_jobs(self, param: torch.Tensor, matrix: torch.Tensor) -> list[torch.Tensor]:
        """The 2-D matrices NS runs on for one full matrix: Q, K, V apart under QKV split."""
        shapes = self._qkv_split_shapes(param)
        if shapes is None:
            return [matrix]
        rows, cols = matrix.shape
        if rows % sum(shapes) != 0:
            raise RuntimeError(
                f"Muon QKV split shape mismatch: grad_shape={tuple(matrix.shape)}, "
                f"split_shapes={shapes}"
            )
        groups = rows // sum(shapes)
        pieces = torch.split(matrix.view(groups, sum(shapes), cols), shapes, dim=1)
        return [piece.reshape(-1, cols) for piece in pieces]

    def _assemble(
        self, param: torch.Tensor, matrix: torch.Tensor, results: list[torch.Tensor]
    ) -> torch.Tensor:
        """Inverse of ``_ns_jobs``: the full orthogonalized matrix from its jobs' results."""
        if len(results) == 1:
            return results[0]
        rows, cols = matrix.shape
        groups = rows // sum(self._qkv_split_shapes(param))  # type: ignore[arg-type]
        return torch.cat([r.view(groups, -1, cols) for r in results], dim=1).view(rows, cols)

    def _tp_group(self, param: torch.Tensor) -> dist.ProcessGroup | None:
        if self.pg_collection is None:
            return None
        return (
            self.pg_collection.expt_tp
            if getattr(param, "expert_tp", False)
            else self.pg_collection.tp
        )

    def _needs_tp_collectives(self, param: torch.Tensor) -> bool:
        """True when TensorParallelMuon would communicate over TP for this param."""
        if self.tp_mode == "blockwise":
            return False
        partition_dim = getattr(param, "partition_dim", None)
        if partition_dim is None or partition_dim == -1:
            return False
        group = self._tp_group(param)
        return group is not None and dist.get_world_size(group) > 1

    # ----------------------------------------------------------------------------------------------
    # the static plan: layouts, owners, buckets
    # ----------------------------------------------------------------------------------------------

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _step_plan(self) -> _StepPlan:
        params = self._all_params()
        if (
            self._plan is not None
            and len(self._plan.params) == len(params)
            and all(a is b for a, b in zip(self._plan.params, params, strict=True))
        ):
            self._plan.groups = [g for g in self.param_groups for _ in g["params"]]
            return self._plan
        self._plan = self._build_plan(params)
        return self._plan

    def _build_plan(self, params: list[torch.Tensor]) -> _StepPlan:
        """Layouts (one all_gather), owners, work blocks, split groups and buckets.

        Collective over ``dp_group`` (and, for split matrices, over each split block's ranks).
        """
        # Without torch.distributed (one process) every param is whole: DP size 1.
        dp_size = dist.get_world_size(self.dp_group) if dist.is_initialized() else 1
        check_same_params(params, self.dp_group)
        layouts = gather_row_layouts(params, self.dp_group)
        matrices = [i for i, p in enumerate(params) if p.ndim == 2]
        experts = [i for i, p in enumerate(params) if p.ndim == 3]
        pieces = [self._ns_pieces(params[i], layouts[i]) for i in matrices]
        costs = [sum(self.ns_config.flops(r, c) for r, c in job) for job in pieces]
        if dp_size > 1 and self.ns_config.splittable:
            splittable = [
                None if self._needs_tp_collectives(params[i]) else job
                for i, job in zip(matrices, pieces, strict=True)
            ]
            owner_plan = plan_split_owners(
                costs,
                dp_size,
                splittable,
                self.ns_config.num_ns_steps,
                min_split_cost=self.min_split_flops,
            )
        else:
            owner_plan = plan_owners(costs, dp_size)
        work = [
            self._work_blocks(owner_plan, m, layouts[i], pieces[m]) for m, i in enumerate(matrices)
        ]
        return _StepPlan(
            params=params,
            groups=[g for g in self.param_groups for _ in g["params"]],
            layouts=layouts,
            matrices=matrices,
            experts=experts,
            owner_plan=owner_plan,
            buckets=self._buckets([layouts[i] for i in matrices]),
            dp_size=dp_size,
            work=work,
            split_groups=self._split_groups(owner_plan),
        )

    def _ns_pieces(self, param: torch.Tensor, layout: RowLayout) -> list[tuple[int, int]]:
        """``(rows, cols)`` of a full matrix's NS jobs: Q, K, V under QKV split, else itself."""
        rows, cols = layout.num_rows, layout.row_shape[0]
        shapes = self._qkv_split_shapes(param)
        if shapes is None or rows % sum(shapes) != 0:
            return [(rows, cols)]
        groups = rows // sum(shapes)
        return [(groups * s, cols) for s in shapes]

    def _ns_cost(self, param: torch.Tensor, layout: RowLayout) -> int:
        """NS FLOPs of a full matrix (sum over Q, K, V under QKV split); same on every TP rank."""
        return sum(self.ns_config.flops(r, c) for r, c in self._ns_pieces(param, layout))

    @staticmethod
    def _work_blocks(
        plan: OwnerPlan, m: int, layout: RowLayout, pieces: list[tuple[int, int]]
    ) -> list[WorkBlock]:
        """Matrix ``m``'s work: the whole matrix on its owner, or blocks along its long dim."""
        size = plan.split_size(m)
        if size == 1:
            return [WorkBlock.whole(plan.owners[m], layout)]
        rows, cols = layout.num_rows, layout.row_shape[0]
        members = list(plan.members(m))
        if split_dim_of_pieces(pieces) == 0:
            return [
                WorkBlock(rank, start, stop, 0, cols)
                for rank, (start, stop) in zip(members, split_bounds(rows, size), strict=True)
            ]
        return [
            WorkBlock(rank, 0, rows, start, stop)
            for rank, (start, stop) in zip(members, split_bounds(cols, size), strict=True)
        ]

    def _split_groups(self, plan: OwnerPlan) -> dict[tuple[int, int], dist.ProcessGroup]:
        """A process group per split block this rank belongs to, keyed ``(first rank, size)``.

        Created in one global order on every member, with local synchronization so ranks outside
        a block (and other data-parallel groups) need not take part.
        """
        # One global creation order (largest blocks first) on every rank: with local
        # synchronization, creating a block before a larger block containing it deadlocks gloo.
        blocks = sorted(
            {(plan.owners[m], plan.split_size(m)) for m in plan.split_matrices()},
            key=lambda block: (-block[1], block[0]),
        )
        if not blocks:
            return {}
        my_rank = dist.get_rank(self.dp_group)
        global_ranks = dist.get_process_group_ranks(self.dp_group or dist.group.WORLD)
        groups = {}
        for first, size in blocks:
            if not first <= my_rank < first + size:
                continue
            members = [global_ranks[r] for r in range(first, first + size)]
            if members != sorted(members):
                raise ValueError("split NS needs data-parallel ranks in increasing global order")
            groups[(first, size)] = dist.new_group(members, use_local_synchronization=True)
        return groups

    def _buckets(self, layouts: list[RowLayout]) -> list[list[int]]:
        """Consecutive matrices whose full fp32 bytes stay within ``bucket_size_bytes``."""
        if self.bucket_size_bytes is None:
            return [list(range(len(layouts)))] if layouts else []
        buckets: list[list[int]] = []
        current: list[int] = []
        current_bytes = 0
        for m, layout in enumerate(layouts):
            size = 4 * layout.num_rows * layout.row_numel
            if current and current_bytes + size > self.bucket_size_bytes:
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(m)
            current_bytes += size
        if current:
            buckets.append(current)
        return buckets

    def owner_plan(self) -> OwnerPlan:
        """The owner of each 2-D matrix (in param order); builds the plan if needed (collective)."""
        return self._step_plan().owner_plan
