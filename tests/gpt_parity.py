"""Train a tiny megatron-core GPTModel under Megatron-FSDP with ``build_muon_optimizer`` and, in
the same rank, an unsharded single-process reference (``TensorParallelMuon`` + AdamW on full
tensors, same routing, same data); report every param's deviation. Runs inside harness ranks.

The reference is written out here by hand (names -> optimizer, weight decay on matrices only,
``torch.nn.utils.clip_grad_norm_``), independent of the factory's routing code.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

VOCAB = 256
SEQ = 32
MICRO_BATCH = 2  # sequences per rank per micro-batch
NUM_EXPERTS = 4

LR = 1e-2
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
EPS = 1e-8
MOMENTUM = 0.9
ADAPTIVE_BETA2 = 0.9
CLIP_GRAD = 0.3  # below the tiny GPT's grad norm (~1.4): clipping is active at every step


@dataclass(frozen=True)
class Run:
    """One training run: wrapper, strategy and loop flavour.

    The loop (``train``): one optimizer step per batch, the batch's ``num_microbatches``
    backwards before it. ``accumulate="no_sync"`` runs every micro-batch but the last under
    ``no_sync()`` (Megatron's schedule), ``"plain"`` runs them all outside it; with one
    micro-batch both are the plain loop zero_grad -> backward -> step. ``megatron_loop`` is
    Megatron-LM's loop: its schedule enters ``no_sync()`` (only with ``overlap_grad_reduce``, as
    ``train()`` sets ``config.no_sync_func``) around every micro-batch but the last, then
    ``finalize_model_grads`` calls ``finish_grad_sync()``, and the optimizer is built with
    ``grads_already_synced=True``.
    """

    # "mcore" / "mcore_hsdp" (FullyShardedDataParallel), "fully_shard" / "fully_shard_hsdp"
    wrapper: str
    strategy: str
    num_microbatches: int = 1
    megatron_loop: bool = False
    mode: str = "owner"
    overlap_grad_reduce: bool = True
    accumulate: str = "no_sync"  # or "plain"
    # fully_shard_model's sync_model_each_microbatch; None: True for one micro-batch, else False.
    sync_model_each_microbatch: bool | None = None


def optimizer_config(**overrides):
    from megatron.core.optimizer import OptimizerConfig

    kwargs = dict(
        optimizer="muon",
        lr=LR,
        min_lr=LR,
        weight_decay=WEIGHT_DECAY,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_eps=EPS,
        clip_grad=CLIP_GRAD,
        muon_momentum=MOMENTUM,
        muon_nesterov=True,
        muon_split_qkv=True,
        muon_fp32_matmul_prec="highest",
        muon_tp_mode="blockwise",
        log_num_zeros_in_grad=True,
    )
    kwargs.update(overrides)
    return OptimizerConfig(**kwargs)


# The tiny MLA: 4 heads of query/key 16 + 8 (RoPE), value 16, compressed KV 32; no linear biases.
MLA_CONFIG = dict(
    kv_lora_rank=32,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=16,
    rope_type="rope",
    add_bias_linear=False,
)


def init_megatron(num_distributed_optimizer_instances: int = 1) -> None:
    """megatron-core's process groups (TP=1); 2 optimizer instances = HSDP with 2 replicas."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1,
            num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        )


def build_gpt(moe: bool = False, mla: bool = False, **config_overrides) -> torch.nn.Module:
    """The tiny GPTModel (local spec, 2 layers, hidden 64, 4 heads, vocab 256, seq 32), seed 0.

    ``mla``: Multi-Latent Attention (``MLA_CONFIG``; ``q_lora_rank`` in ``config_overrides``
    turns on the query's low-rank projection), RoPE positions, no learned position embedding.

    ``config_overrides`` go to its ``TransformerConfig`` (e.g. ``tensor_model_parallel_size``,
    ``num_query_groups``); with ``use_cpu_initialization`` every TP rank's partition is its chunk
    of the same full weight, so TP > 1 models hold the TP = 1 model's weights.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    moe_kwargs = (
        dict(
            num_moe_experts=NUM_EXPERTS,
            moe_router_topk=2,
            moe_grouped_gemm=False,
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            # SequentialMLP adds an expert's output bias in place on a TP-region view: autograd
            # refuses (megatron-core 0.19.2, local spec); MoE models run without linear biases.
            add_bias_linear=False,
        )
        if moe
        else {}
    )
    config_class = TransformerConfig
    if mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class = MLATransformerConfig
        config_overrides = {**MLA_CONFIG, **config_overrides}
    config = config_class(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **moe_kwargs,
        **config_overrides,
    )
    spec = get_gpt_layer_local_spec(
        num_experts=NUM_EXPERTS if moe else None, multi_latent_attention=mla
    )
    if mla:
        return GPTModel(
            config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope"
        )
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def wrap(model: torch.nn.Module, run: Run, world_size: int) -> torch.nn.Module:
    """Megatron-FSDP around ``model``: megatron-core's wrapper or megatron_fsdp's own."""
    if run.wrapper in ("mcore", "mcore_hsdp"):
        from megatron.core.distributed import (
            DistributedDataParallelConfig,
            FullyShardedDataParallel,
        )

        hsdp = (
            {"num_distributed_optimizer_instances": 2, "outer_dp_sharding_strategy": "no_shard"}
            if run.wrapper == "mcore_hsdp"
            else {}
        )
        ddp_config = DistributedDataParallelConfig(
            data_parallel_sharding_strategy=run.strategy,
            use_megatron_fsdp=True,
            gradient_reduce_div_fusion=False,
            overlap_grad_reduce=run.overlap_grad_reduce,
            **hsdp,
        )
        return FullyShardedDataParallel(model.config, ddp_config, model, device=torch.device("cpu"))
    import megatron_fsdp
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed.device_mesh import init_device_mesh

    if run.wrapper == "fully_shard_hsdp":
        # HSDP: 2 replicas (outer dim, outer no_shard) x world/2 shards (inner strategy).
        mesh = init_device_mesh(
            "cpu", (2, world_size // 2, 1), mesh_dim_names=("outer", "fsdp", "tp")
        )
        hsdp = {
            "dp_outer_dim": "outer",
            "hybrid_fsdp_group": mesh["outer", "fsdp"]._flatten("hsdp").get_group(),
            "outer_dp_sharding_strategy": "no_shard",
        }
    else:
        mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("fsdp", "tp"))
        hsdp = {}
    # The default (True) reduces every micro-batch's gradient in place into the accumulated buffer
    # under no_shard/optim: gradient accumulation needs it off (megatron_fsdp's own advice).
    sync_each = run.sync_model_each_microbatch
    kwargs = {
        "sync_model_each_microbatch": run.num_microbatches == 1 if sync_each is None else sync_each,
        "overlap_grad_reduce": run.overlap_grad_reduce,
    }
    if run.strategy == "optim_grads_params":
        kwargs["fsdp_unit_modules"] = [TransformerLayer]
    return megatron_fsdp.fully_shard_model(
        model,
        device_mesh=mesh,
        dp_shard_dim="fsdp",
        tp_dim="tp",
        device=torch.device("cpu"),
        zero_dp_strategy=run.strategy,
        **hsdp,
        **kwargs,
    )


def batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole step's tokens and labels, ``(world * microbatches * MICRO_BATCH, SEQ)``."""
    generator = torch.Generator().manual_seed(1000 + step)
    shape = (world_size * 2 * MICRO_BATCH, SEQ)
    return (
        torch.randint(0, VOCAB, shape, generator=generator),
        torch.randint(0, VOCAB, shape, generator=generator),
    )


def loss_of(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(SEQ, device=tokens.device).expand(tokens.shape)
    ones = torch.ones(SEQ, SEQ, dtype=torch.bool, device=tokens.device)
    causal = torch.triu(ones, diagonal=1)[None, None]
    losses = model(input_ids=tokens, position_ids=positions, attention_mask=causal, labels=labels)
    return losses.float().mean()


# --------------------------------------------------------------------------------------------------
# the reference: one process, full tensors, same routing written out by name
# --------------------------------------------------------------------------------------------------


def reference_routes_to_muon(name: str, param: torch.Tensor) -> bool:
    return param.ndim == 2 and "embedding" not in name and "output_layer" not in name


class Reference:
    """TensorParallelMuon (matrices; with ``moment2_method``, the fixed TensorParallelAdaptiveMuon)
    + AdamW (the rest; no weight decay on 1-D) on full tensors."""

    def __init__(
        self, model: torch.nn.Module, *, moment2_method: str | None = None, lr: float = LR
    ) -> None:
        from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

        from megatron_muon.integrations.adaptive_muon_fix import TensorParallelAdaptiveMuonFixed

        adaptive: dict = {}
        if moment2_method is not None:
            adaptive = dict(moment2_method=moment2_method, beta2=ADAPTIVE_BETA2)
        self.model = model
        named = list(model.named_parameters())
        muon = [p for n, p in named if reference_routes_to_muon(n, p)]
        decayed = [p for n, p in named if not reference_routes_to_muon(n, p) and p.ndim >= 2]
        undecayed = [p for n, p in named if p.ndim < 2]
        heads = model.config.num_attention_heads
        kv = model.config.kv_channels
        self.muon = (TensorParallelAdaptiveMuonFixed if adaptive else TensorParallelMuon)(
            muon,
            lr=lr,
            momentum=MOMENTUM,
            nesterov=True,
            weight_decay=WEIGHT_DECAY,
            split_qkv=True,
            is_qkv_fn=lambda p: p.shape == (3 * heads * kv, model.config.hidden_size),
            qkv_split_shapes=[kv, kv, kv],  # per query group (4 groups of 1 head each)
            fp32_matmul_prec="highest",
            tp_mode="blockwise",
            **adaptive,
        )
        self.adamw = torch.optim.AdamW(
            [
                {"params": decayed, "weight_decay": WEIGHT_DECAY},
                {"params": undecayed, "weight_decay": 0.0},
            ],
            lr=lr,
            betas=BETAS,
            eps=EPS,
        )
        self.optimizers: list[torch.optim.Optimizer] = [self.muon, self.adamw]

    def step(
        self, tokens: torch.Tensor, labels: torch.Tensor, num_chunks: int = 1
    ) -> tuple[float, float, int]:
        """(loss, grad norm before clipping, zero grad elements) of one full-batch step.

        ``num_chunks > 1``: the batch's gradient accumulated over that many equal chunks, in
        order (the same math in another reduction order: the noise floor of a parity test).
        """
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        loss = torch.zeros(())
        for chunk_tokens, chunk_labels in zip(
            tokens.chunk(num_chunks), labels.chunk(num_chunks), strict=True
        ):
            chunk_loss = loss_of(self.model, chunk_tokens, chunk_labels) / num_chunks
            chunk_loss.backward()
            loss = loss + chunk_loss.detach().cpu()
        params = [p for p in self.model.parameters() if p.grad is not None]
        zeros = sum(int((p.grad == 0).sum()) for p in params)
        norm = torch.nn.utils.clip_grad_norm_(params, CLIP_GRAD)
        for optimizer in self.optimizers:
            optimizer.step()
        return float(loss.detach()), float(norm), zeros


# --------------------------------------------------------------------------------------------------
# the sharded run
# --------------------------------------------------------------------------------------------------


def train(
    run: Run,
    rank: int,
    world_size: int,
    steps: int,
    moe: bool = False,
    *,
    config: Any = None,
    reference_class: type[Reference] | None = None,
    **build_kwargs,
) -> dict:
    """Trains a sharded copy and the reference side by side; returns deviations and stats.

    ``config``: the ``OptimizerConfig`` (default ``optimizer_config()``, Muon) and
    ``reference_class`` its unsharded reference (default ``Reference``); ``build_kwargs`` go to
    ``build_gpt`` (e.g. ``mla=True``), for all three models alike."""
    from megatron_muon import MuonFsdpConfig, build_muon_optimizer

    reference_class = reference_class or Reference
    # Same seeds: the same initial weights.
    reference = reference_class(build_gpt(moe, **build_kwargs))
    # The same reference, its batch gradient accumulated rank by rank and micro-batch by
    # micro-batch: fp32 reduction order is all it changes (the tests' noise floor).
    reordered = reference_class(build_gpt(moe, **build_kwargs))
    num_chunks = world_size * run.num_microbatches
    model = build_gpt(moe, **build_kwargs)
    wrapped = wrap(model, run, world_size)
    named = dict(
        wrapped.named_parameters()
    )  # the optimizer params (DTensors), right after wrapping
    optimizer = build_muon_optimizer(
        config or optimizer_config(),
        [wrapped],
        fsdp_config=MuonFsdpConfig(mode=run.mode),
        grads_already_synced=run.megatron_loop,
    )
    fsdp = optimizer.fsdp_modules[0]
    stats = []
    for step in range(steps):
        tokens, labels = batch(step, world_size)
        reference_loss, reference_norm, reference_zeros = reference.step(tokens, labels)
        reordered_loss, reordered_norm, _ = reordered.step(tokens, labels, num_chunks)
        optimizer.zero_grad()
        mine = tokens.view(world_size, -1, SEQ)[rank], labels.view(world_size, -1, SEQ)[rank]
        losses = _forward_backward(run, wrapped, fsdp, *mine)
        ok, grad_norm, num_zeros = optimizer.step()
        assert ok
        loss_sum = torch.tensor([sum(losses)])
        dist.all_reduce(loss_sum)
        stats.append(
            {
                "loss": float(loss_sum) / world_size,
                "reference_loss": reference_loss,
                "grad_norm": float(grad_norm),
                "reference_grad_norm": reference_norm,
                "reordered_loss": reordered_loss,
                "reordered_grad_norm": reordered_norm,
                "num_zeros": num_zeros,
                "reference_num_zeros": reference_zeros,
            }
        )
    return {
        "deviations": deviations(optimizer, named, reference.model),
        "floor": reduction_order_floor(reordered.model, reference.model),
        "stats": stats,
        "routing": [(r.name, r.optimizer, r.is_expert) for r in optimizer.routing],
        "summary": list(optimizer.summary_lines),
    }


def _forward_backward(run: Run, model, fsdp, tokens, labels) -> list[float]:
    """One optimizer step's micro-batches, forward and backward, as ``run``'s loop drives them."""
    micro = list(
        zip(tokens.chunk(run.num_microbatches), labels.chunk(run.num_microbatches), strict=True)
    )
    if run.megatron_loop:
        no_sync = fsdp.no_sync if run.overlap_grad_reduce else contextlib.nullcontext
    elif run.accumulate == "no_sync" and len(micro) > 1:
        no_sync = fsdp.no_sync
    else:
        no_sync = contextlib.nullcontext
    losses = []
    with no_sync():
        for tok, lab in micro[:-1]:
            losses.append(_backward(model, tok, lab, run.num_microbatches))
    losses.append(_backward(model, *micro[-1], run.num_microbatches))
    if run.megatron_loop:
        fsdp.finish_grad_sync()  # what Megatron-LM's finalize_model_grads does
    return losses


def _backward(model, tokens, labels, num_microbatches: int) -> float:
    loss = loss_of(model, tokens, labels) / num_microbatches
    loss.backward()
    return float(loss.detach())


def _strip(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def deviations(
    optimizer, named: dict[str, torch.Tensor], reference_model: torch.nn.Module
) -> dict[str, tuple]:
    """name -> (row start, row stop, ||mine - reference rows||^2, ||reference||) on this rank.

    In ``linear_qkv.bias`` the key-bias rows are left out: their gradient is mathematically zero
    (a key bias shifts every score of a query equally; softmax ignores it), ~1e-12 with either
    sign in fp32, which AdamW's m / (sqrt(v) + eps) turns into noise.
    """
    from megatron_muon.engine.layout import local_tensor

    reference = {n: p.detach() for n, p in reference_model.named_parameters()}
    out = {}
    for entry in optimizer.routing:
        param = named[entry.name]
        name = _strip(entry.name)
        local = local_tensor(param.detach())
        row_numel = max(1, local.shape[1:].numel())
        if tuple(local.shape) == tuple(param.shape):
            start = 0
        else:
            start = param.megatron_fsdp_slice.start // row_numel
        full = reference[name]
        keep = ~_k_bias_rows(name, full.shape[0]) if name.endswith("linear_qkv.bias") else None
        rows = full[start : start + local.shape[0]]
        difference = (local - rows).double()
        if keep is not None:
            difference = difference[keep[start : start + local.shape[0]]]
            full = full[keep]
        out[name] = (
            start,
            start + local.shape[0],
            float(difference.square().sum()),
            float(full.double().norm()),
        )
    return out


def reduction_order_floor(
    reordered: torch.nn.Module, reference: torch.nn.Module
) -> dict[str, float]:
    """name -> relative error (Frobenius) of the reordered reference against the reference: what
    fp32 reduction order alone does to this param over the same steps (key-bias rows left out,
    as in ``deviations``)."""
    full = dict(reference.named_parameters())
    floors = {}
    for name, param in reordered.named_parameters():
        mine, theirs = param.detach().double(), full[name].detach().double()
        if name.endswith("linear_qkv.bias"):
            keep = ~_k_bias_rows(name, theirs.shape[0])
            mine, theirs = mine[keep], theirs[keep]
        floors[name] = float((mine - theirs).norm() / theirs.norm().clamp_min(1e-12))
    return floors


def _k_bias_rows(name: str, num_rows: int) -> torch.Tensor:
    """Rows of a ``linear_qkv.bias`` that are the key bias (per query group: [Q | K | V])."""
    group = num_rows // 4  # 4 query groups of one head each: [16 Q | 16 K | 16 V]
    rows = torch.zeros(num_rows, dtype=torch.bool)
    for start in range(0, num_rows, group):
        rows[start + group // 3 : start + 2 * group // 3] = True
    return rows


# A sharded run may deviate from the reference by at most this many times the largest deviation
# that fp32 reduction order alone causes between two runs of the reference, measured in the same
# launch (``train``'s "floor"). Measured on Intel AVX-512 and with the kernels limited to AVX2:
# the sharded deviation is 0.9-1.7x the floor param by param, at most 1.2x the largest floor (both
# ~1e-5 after 5 steps: Newton-Schulz amplifies the ~1e-7 reduction noise of small singular values).
# A lost, doubled or misplaced update deviates by 1e-3 or more.
FLOOR_FACTOR = 2.0


def assert_within_floor(per_rank: list[dict], floor: dict[str, float]) -> dict[str, float]:
    """Asserts every param's whole-param relative error is at most ``FLOOR_FACTOR`` times the
    largest reduction-order floor; returns the errors."""
    errors = relative_errors([result["deviations"] for result in per_rank])
    bound = FLOOR_FACTOR * max(floor.values())
    for name, error in errors.items():
        assert error <= bound, (
            f"{name}: relative error {error:.2e} > {FLOOR_FACTOR} x the reduction-order floor "
            f"{max(floor.values()):.2e} (this param's floor {floor[name]:.2e})"
        )
    return errors


def relative_errors(per_rank: list[dict[str, tuple]]) -> dict[str, float]:
    """Whole-param relative error: rank pieces summed over distinct row ranges (replicas once)."""
    errors = {}
    for name in per_rank[0]:
        pieces: dict[tuple[int, int], float] = {}
        norm = per_rank[0][name][3]
        for result in per_rank:
            start, stop, squared, _ = result[name]
            if stop > start:
                pieces[(start, stop)] = max(pieces.get((start, stop), 0.0), squared)
        errors[name] = (sum(pieces.values()) ** 0.5) / max(norm, 1e-12)
    return errors


def _rows_by_name(named: dict, attribute: str) -> dict[str, tuple[int, torch.Tensor]]:
    """name -> (first row, this rank's rows) of every optimizer param's ``attribute`` (``data``
    or ``grad``; a rank holding no rows has ``grad is None``)."""
    from megatron_muon.engine.layout import local_tensor

    out = {}
    for name, param in named.items():
        local = local_tensor(param.detach())
        value = getattr(param, attribute)
        rows = local_tensor(value.detach()).clone() if value is not None else local * 0
        row_numel = max(1, local.shape[1:].numel())
        full_rows = tuple(local.shape) == tuple(param.shape)
        start = 0 if full_rows else param.megatron_fsdp_slice.start // row_numel
        out[_strip(name)] = (start, rows)
    return out


def whole_by_name(named: dict, attribute: str) -> dict[str, torch.Tensor]:
    """name -> the whole ``attribute`` tensor, from every rank's rows (one all_gather_object)."""
    import torch.distributed as dist

    pieces: list = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, _rows_by_name(named, attribute))
    whole = {}
    for name in pieces[0]:
        rows = sorted({(p[name][0], p[name][1].shape[0]): p[name][1] for p in pieces}.items())
        whole[name] = torch.cat([r for (_, _), r in rows])
    return whole
