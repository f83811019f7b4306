"""The Muon parameter shapes the optimizer factory would route, per rank, of a model
(``model_specs.ModelSpec``) at a parallel layout (``Parallelism``).

``muon_matrices`` lists the 2-D weights megatron-core's factory gives Muon
(every 2-D param that is not an embedding or the output layer: attention and MLP linears, MoE
routers, shared experts and experts; ``_get_megatron_emerging_optimizer``), in the optimizer's param
order (``named_parameters`` of megatron-core's GPT layer specs), with their tensor-parallel-local
shapes under ``tp_mode="blockwise"`` (Megatron's default ``--muon-tp-mode``):

- ``linear_qkv`` ``(num_query_groups / tp * sum(split), hidden)``, orthogonalized as its Q, K and V
  pieces (``--muon-split-qkv``, ``qkv_split_shapes = [heads / groups * kv_channels, kv_channels,
  kv_channels]`` per query group);
- ``linear_proj`` ``(hidden, heads * kv_channels / tp)``; ``linear_fc1`` ``(ffn * (2 if gated) / tp,
  hidden)``; ``linear_fc2`` ``(hidden, ffn / tp)``;
- multi-latent attention (no QKV split: megatron-core's "TODO support MLA"): ``linear_q_down_proj``
  and ``linear_kv_down_proj`` (duplicated over TP), ``linear_q_up_proj``, ``linear_kv_up_proj``
  (column-parallel), ``linear_proj`` (row-parallel);
- MoE layers: ``router.weight`` ``(num_experts, hidden)`` (dense, replicated over TP), the local
  experts' ``linear_fc1`` / ``linear_fc2`` (per-expert 2-D weights, as TE's grouped linear holds
  them; expert-TP-local), shared experts (dense).

Dense matrices are sharded (and planned) over the data-parallel group, experts over the
expert-data-parallel group, as two optimizer instances.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_muon.plan.model_specs import ModelSpec

__all__ = ["Matrix", "MuonParams", "Parallelism", "default_parallelism", "muon_matrices"]


@dataclass(frozen=True, slots=True)
class Parallelism:
    """Data, tensor and expert parallel sizes (pipeline and context parallel size 1).

    ``expt_dp`` defaults to ``dp * tp / (ep * expert_tp)`` with ``expert_tp = tp`` (Megatron's
    default ``--expert-tensor-parallel-size``); given explicitly, ``expert_tp`` follows from it.
    """

    dp: int
    tp: int = 1
    ep: int = 1
    expt_dp: int | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        world = self.dp * self.tp
        if self.expt_dp is not None:
            if self.expt_dp < 1 or world % (self.ep * self.expt_dp):
                raise ValueError(
                    f"expt_dp={self.expt_dp} x ep={self.ep} must divide dp x tp = {world}"
                )
        elif world % (self.ep * self.tp):
            raise ValueError(f"ep={self.ep} x tp={self.tp} must divide dp x tp = {world}")

    @property
    def world_size(self) -> int:
        """Ranks in one pipeline stage: ``dp * tp``."""
        return self.dp * self.tp

    @property
    def expert_dp(self) -> int:
        """Size of the expert-data-parallel group experts are sharded (and planned) over."""
        if self.expt_dp is not None:
            return self.expt_dp
        return self.world_size // (self.ep * self.tp)

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size implied by the others."""
        return self.world_size // (self.ep * self.expert_dp)


@dataclass(frozen=True, slots=True)
class Matrix:
    """One 2-D Muon param as its optimizer sees it (DP-full, TP-local).

    Attributes:
        name: megatron-core param name (``decoder.layers.3.mlp.linear_fc1.weight``).
        shape: ``(rows, cols)``, tensor-parallel-local.
        pieces: the 2-D matrices NS runs on: ``(shape,)``, or Q, K, V of a QKV-split param.
        unit: the FSDP unit (transformer layer) whose flat bucket holds it.
    """

    name: str
    shape: tuple[int, int]
    pieces: tuple[tuple[int, int], ...]
    unit: int

    @property
    def tp_dim(self) -> int | None:
        """The dim TP splits (``partition_dim``): 0 column-parallel (QKV, FC1, MLA up-projections),
        1 row-parallel (output projection, FC2), ``None`` whole on every TP rank (router, MLA
        down-projections)."""
        layer = self.name.rsplit(".weight", 1)[0].rsplit(".", 1)[-1]
        if layer in ("linear_proj", "linear_fc2"):
            return 1
        if layer in ("router", "linear_q_down_proj", "linear_kv_down_proj"):
            return None
        return 0

    def tp_full(self, tp: int) -> Matrix:
        """This TP-local matrix as the whole weight over ``tp`` ranks (its ``tp_dim`` times
        ``tp``; QKV pieces: every query group)."""
        dim = self.tp_dim
        if dim is None or tp == 1:
            return self

        def grow(shape: tuple[int, int]) -> tuple[int, int]:
            return (shape[0] * tp, shape[1]) if dim == 0 else (shape[0], shape[1] * tp)

        return Matrix(self.name, grow(self.shape), tuple(grow(p) for p in self.pieces), self.unit)


@dataclass(frozen=True, slots=True)
class MuonParams:
    """The Muon matrices of one rank, per optimizer instance, in param order."""

    dense: tuple[Matrix, ...]
    experts: tuple[Matrix, ...] = field(default=())


def _divide(value: int, by: int, what: str) -> int:
    if value % by:
        raise ValueError(f"{what} = {value} is not divisible by {by}")
    return value // by


def _linear(name: str, rows: int, cols: int, unit: int) -> Matrix:
    return Matrix(name=name, shape=(rows, cols), pieces=((rows, cols),), unit=unit)


def _attention(spec: ModelSpec, tp: int, prefix: str, unit: int) -> list[Matrix]:
    hidden, heads = spec.hidden_size, spec.num_attention_heads
    local_heads = _divide(heads, tp, "num_attention_heads")
    if spec.multi_latent_attention:
        qk = spec.qk_head_dim + spec.qk_pos_emb_head_dim
        out = [_linear(f"{prefix}.linear_proj.weight", hidden, local_heads * spec.v_head_dim, unit)]
        if spec.q_lora_rank:
            out.append(
                _linear(f"{prefix}.linear_q_down_proj.weight", spec.q_lora_rank, hidden, unit)
            )
            out.append(
                _linear(
                    f"{prefix}.linear_q_up_proj.weight", local_heads * qk, spec.q_lora_rank, unit
                )
            )
        else:
            out.append(_linear(f"{prefix}.linear_q_proj.weight", local_heads * qk, hidden, unit))
        kv_down = spec.kv_lora_rank + spec.qk_pos_emb_head_dim
        out.append(_linear(f"{prefix}.linear_kv_down_proj.weight", kv_down, hidden, unit))
        kv_up = local_heads * (spec.qk_head_dim + spec.v_head_dim)
        out.append(_linear(f"{prefix}.linear_kv_up_proj.weight", kv_up, spec.kv_lora_rank, unit))
        return out
    head_dim = spec.head_dim
    groups = _divide(spec.query_groups, tp, "num_query_groups")
    split = (heads // spec.query_groups * head_dim, head_dim, head_dim)
    qkv = Matrix(
        name=f"{prefix}.linear_qkv.weight",
        shape=(groups * sum(split), hidden),
        pieces=tuple((groups * s, hidden) for s in split),
        unit=unit,
    )
    proj = _linear(f"{prefix}.linear_proj.weight", hidden, local_heads * head_dim, unit)
    return [proj, qkv]


def _mlp(spec: ModelSpec, ffn: int, tp: int, prefix: str, unit: int) -> list[Matrix]:
    local = _divide(ffn, tp, f"{prefix} ffn size")
    up = local * (2 if spec.gated_linear_unit else 1)
    return [
        _linear(f"{prefix}.linear_fc1.weight", up, spec.hidden_size, unit),
        _linear(f"{prefix}.linear_fc2.weight", spec.hidden_size, local, unit),
    ]


def muon_matrices(spec: ModelSpec, parallel: Parallelism) -> MuonParams:
    """The Muon matrices one rank's optimizers hold, dense and expert, in param order.

    Raises:
        ValueError: sizes not divisible by the parallel sizes.
    """
    tp = parallel.tp
    dense: list[Matrix] = []
    experts: list[Matrix] = []
    for layer in range(spec.num_layers):
        prefix = f"decoder.layers.{layer}"
        dense += _attention(spec, tp, f"{prefix}.self_attention", layer)
        if not spec.is_moe_layer(layer):
            dense += _mlp(spec, spec.ffn_hidden_size, tp, f"{prefix}.mlp", layer)
            continue
        num_experts = spec.num_experts or 0
        dense.append(_linear(f"{prefix}.mlp.router.weight", num_experts, spec.hidden_size, layer))
        local_experts = _divide(num_experts, parallel.ep, "num_experts")
        moe_ffn = _divide(spec.moe_ffn_hidden_size or 0, parallel.expert_tp, "moe_ffn_hidden_size")
        up = moe_ffn * (2 if spec.gated_linear_unit else 1)
        experts += [
            _linear(f"{prefix}.mlp.experts.linear_fc1.weight{e}", up, spec.hidden_size, layer)
            for e in range(local_experts)
        ]
        experts += [
            _linear(f"{prefix}.mlp.experts.linear_fc2.weight{e}", spec.hidden_size, moe_ffn, layer)
            for e in range(local_experts)
        ]
        if spec.moe_shared_expert_intermediate_size:
            shared = spec.moe_shared_expert_intermediate_size
            dense += _mlp(spec, shared, tp, f"{prefix}.mlp.shared_experts", layer)
    return MuonParams(dense=tuple(dense), experts=tuple(experts))


def default_parallelism(
    spec: ModelSpec, dp: int, tp: int = 1, ep: int | None = None, expt_dp: int | None = None
) -> Parallelism:
    """``Parallelism`` with ``ep`` defaulting to the preset's, halved until it fits ``dp x tp``."""
    if ep is None:
        ep = spec.default_ep if spec.num_experts else 1
        while ep > 1 and (dp * tp) % (ep * tp):
            ep //= 2
    return Parallelism(dp=dp, tp=tp, ep=ep, expt_dp=expt_dp)
