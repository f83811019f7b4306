"""The optimizer Megatron-LM's loop drives: the FSDP step wrapper, in ``fsdp_dtensor`` checkpoints.

``build_muon_optimizer(..., ckpt_format="fsdp_dtensor")`` returns a
``MegatronCheckpointedOptimizer``; ``install()``'s ``get_megatron_optimizer`` asks for it. Nothing
here patches Megatron: the class answers the calls Megatron-LM's ``save_checkpoint`` and
``load_checkpoint`` make on an optimizer, and ``megatron_args()`` reads the arguments Megatron-LM
parsed (``megatron.training.get_args()``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

import torch

from megatron_muon.fsdp.qk_clip import QKClip
from megatron_muon.fsdp.step_wrapper import FsdpStepWrapper

__all__ = ["MegatronCheckpointedOptimizer", "megatron_args"]


def megatron_args() -> argparse.Namespace | None:
    """Megatron's parsed arguments (``megatron.training.get_args()``), or None before a Megatron-LM
    script parsed them (``get_args`` asserts "args is not initialized." then)."""
    from megatron.training import get_args

    try:
        return get_args()
    except AssertionError:
        return None


class MegatronCheckpointedOptimizer(FsdpStepWrapper):
    """The FSDP step wrapper, with optimizer state in Megatron's ``fsdp_dtensor`` checkpoints.

    Megatron's ``save_checkpoint``/``load_checkpoint`` (``--ckpt-format fsdp_dtensor``) ask the
    optimizer for ``sharded_state_dict(..., metadata={"distrib_optim_sharding_type":
    "fsdp_dtensor"})`` and hand the loaded result to ``load_state_dict``. megatron-core's
    ``DistributedOptimizer`` answers with its state keyed by parameter name, every tensor a DTensor
    like its parameter, plus ``param_to_group_meta`` (its ``sharded_param_state_fsdp_dtensor``);
    the ``FP32Optimizer`` children of our chain only know the ``torch_dist`` ``ShardedTensor``
    format. This class gives the same layout, all leaf optimizers (Muon, AdamW) in one namespace,
    ``{"state": {name: {key: DTensor | step}}, "param_to_group_meta": {name: {...}}}``, so that
    Megatron's own fsdp_dtensor preprocessing (``--swiglu`` splits, expert renaming) applies.

    State exists for every param on every rank before the state dict is built
    (``megatron_muon.checkpointing.ensure_optimizer_state``, without a step): megatron_fsdp's
    uneven-DTensor preprocessing (one ``all_gather_object`` per DTensor) and DCP planning run
    collectives per DTensor, so a key missing on one rank (a rank holding 0 rows of a param, whose
    grad is None, gets no lazily created state) would hang the save.
    Names are ``DistributedOptimizer._param_name``'s: the model chunks' ``named_parameters()``
    (the Megatron-FSDP optimizer params, e.g. ``module.module.decoder.layers.0...``), with
    Megatron's expert renaming, which ``handle_swiglu_in_state_dict`` resolves on the model.

    A step whose global gradient norm is NaN or Inf is skipped on every rank (the chained
    optimizer's rule); with ``stop_on_nonfinite_grad_norm`` (Megatron's
    ``--check-for-nan-in-loss-and-grad``, on by default) ``step()`` then raises on every rank, so
    the run stops as Megatron stops on a NaN gradient, with the weights of the last good step.

    Args:
        model_chunks: the chunks as ``get_megatron_optimizer`` received them (Megatron's wrappers).
        stop_on_nonfinite_grad_norm: raise after skipping a step with a NaN or Inf grad norm.
        The rest: ``FsdpStepWrapper``'s.
    """

    def __init__(
        self,
        inner: Any,
        fsdp_modules: Sequence[Any],
        *,
        grads_already_synced: bool,
        model_chunks: Any,
        stop_on_nonfinite_grad_norm: bool = True,
        qk_clip: QKClip | None = None,
        routing: Sequence[Any] = (),
        summary_lines: Sequence[str] = (),
    ) -> None:
        super().__init__(
            inner,
            fsdp_modules,
            grads_already_synced=grads_already_synced,
            qk_clip=qk_clip,
            routing=routing,
            summary_lines=summary_lines,
        )
        chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        self.named_chunks = list(chunks)
        self.stop_on_nonfinite_grad_norm = stop_on_nonfinite_grad_norm

    def step(self) -> tuple[bool, float | None, float | None]:
        """``FsdpStepWrapper.step``; raises after a skipped step with a NaN or Inf grad norm.

        Raises:
            RuntimeError: the grad norm is not finite and ``stop_on_nonfinite_grad_norm`` (on every
                rank alike: the norm is global).
        """
        result = super().step()
        update_successful, grad_norm, _ = result
        if (
            self.stop_on_nonfinite_grad_norm
            and not update_successful
            and grad_norm is not None
            and not math.isfinite(grad_norm)
        ):
            args = megatron_args()
            iteration = getattr(args, "curr_iteration", None)
            where = f"iteration {iteration + 1}: " if iteration is not None else ""
            raise RuntimeError(
                f"{where}found {grad_norm} in the global gradient norm (a NaN or Inf gradient on "
                "some rank): the optimizer step was skipped on every rank, the weights are the "
                "last good step's. Stopping, as Megatron-LM does with "
                "--check-for-nan-in-loss-and-grad (pass --no-check-for-nan-in-loss-and-grad to "
                "skip such steps and train on)"
            )
        return result

    def _names(self) -> dict[int, str]:
        from megatron.core.transformer.fsdp_dtensor_checkpoint import (
            handle_experts_in_state_dict,
        )

        name_to_param: dict[str, torch.Tensor] = {}
        for chunk in self.named_chunks:
            name_to_param.update(dict(chunk.named_parameters()))
        config = getattr(self.named_chunks[0], "config", None)
        num_experts = getattr(config, "num_moe_experts", None)
        name_to_param = handle_experts_in_state_dict(name_to_param, num_experts)
        names = {id(param): name for name, param in name_to_param.items()}
        unnamed = [p for p in self.get_parameters() if id(p) not in names]
        if unnamed:
            raise RuntimeError(
                f"{len(unnamed)} optimizer params are not parameters of the model chunks: the "
                "optimizer must be built from Megatron-FSDP's optimizer params"
            )
        return names

    def _leaves(self) -> list[torch.optim.Optimizer]:
        from megatron_muon.checkpointing import leaf_optimizers

        return leaf_optimizers(self.inner)

    def sharded_state_dict(
        self,
        model_sharded_state_dict: Any,
        is_loading: bool = False,
        metadata: dict | None = None,
        **kwargs: Any,
    ) -> dict[str, dict[str, Any]]:
        """Optimizer state by param name, DTensors like the params (save and load template)."""
        from megatron_muon.checkpointing import ensure_optimizer_state

        sharding = (metadata or {}).get("distrib_optim_sharding_type")
        if sharding != "fsdp_dtensor":
            raise NotImplementedError(
                f"Muon with Megatron-FSDP checkpoints in --ckpt-format fsdp_dtensor only, got "
                f"distrib_optim_sharding_type={sharding!r}"
            )
        ensure_optimizer_state(self.inner)
        names = self._names()
        state: dict[str, Any] = {}
        group_meta: dict[str, Any] = {}
        for leaf in self._leaves():
            for group in leaf.param_groups:
                meta = {key: value for key, value in group.items() if key != "params"}
                for param in group["params"]:
                    state[names[id(param)]] = leaf.state[param]
                    group_meta[names[id(param)]] = meta
        return {"state": state, "param_to_group_meta": group_meta}

    def load_state_dict(self, state_dict: Any) -> None:
        """Loads what ``sharded_state_dict`` described (after DCP filled it), by param name."""
        if not (isinstance(state_dict, dict) and "param_to_group_meta" in state_dict):
            super().load_state_dict(state_dict)
            return
        names = self._names()
        saved_state, saved_meta = state_dict["state"], state_dict["param_to_group_meta"]
        for leaf in self._leaves():
            groups = []
            for group in leaf.param_groups:
                params = [names[id(p)] for p in group["params"]]
                missing = [name for name in params if name not in saved_state]
                if missing:
                    raise KeyError(f"the checkpoint holds no optimizer state for {missing}")
                meta = saved_meta.get(params[0], {}) if params else {}
                groups.append({**meta, "params": params})
            state = {name: saved_state[name] for group in groups for name in group["params"]}
            # torch maps saved params to current ones by position in param_groups; both are
            # the current groups' param names, so the name-keyed state lands on the right param.
            leaf.load_state_dict({"state": state, "param_groups": groups})
