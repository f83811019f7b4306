"""The optimizer step contract of Megatron-FSDP, around a chained (Muon + AdamW) optimizer.

Megatron-FSDP keeps two copies of every weight: the optimizer's params (DTensor main weights, rows
sharded over data-parallel ranks under optim/optim_grads/optim_grads_params) and the compute weights
the forward pass reads. An optimizer step on it is:

1. the reduced gradients attached to the optimizer params, reduced exactly once
   (``megatron_muon.fsdp.grad_sync.finish_grad_sync_once``): ``finish_grad_sync()`` alone is right
   only when the backward's reduction matches ``overlap_grad_reduce``, so the wrapper reads from
   Megatron-FSDP's own bookkeeping whether the last backward reduced and launches, waits for or
   runs the one reduction. Inside Megatron-LM's loop ``finalize_model_grads`` has already called
   ``finish_grad_sync()``: ``grads_already_synced=True`` says so, and ``step()`` then refuses to run
   when a backward ran since (the gradients would be unreduced).
2. the inner step: grad norm over all shards, clipping, every sub-optimizer;
3. QK-clip (MuonClip), when a ``QKClip`` is given: the query/key rows of heads whose logits
   exceeded the threshold are scaled on the optimizer params' row shards, after the update and
   before step 4 copies them into the compute weights (``megatron_muon.fsdp.qk_clip``);
4. the new main weights copied into the compute weights, ``install_optimized_model_weights()``,
   and the params re-synced with ``start_param_sync()`` (as megatron-core's DistributedOptimizer
   does for Megatron-FSDP), once per ``MegatronFSDP``.

Every loop below is right under every sharding strategy, with ``overlap_grad_reduce`` on or off
and either wrapper (megatron-core's ``FullyShardedDataParallel``, ``fully_shard_model``):

- the plain loop: ``optimizer.zero_grad(); loss.backward(); optimizer.step()``;
- gradient accumulation over micro-batches, plain (several backwards, then ``step()``: they
  accumulate in Megatron-FSDP's buffers and the step reduces once), or as Megatron's schedule
  does it: every micro-batch but the last under ``module.no_sync()``, the last outside it (its
  backward then launches the reduction, overlapped with the backward when
  ``overlap_grad_reduce=True``);
- Megatron-LM's loop (``grads_already_synced=True``).

Under HSDP the DP-outer reduction runs only in a backward outside ``no_sync()``, so there gradient
accumulation takes Megatron's way (``grad_sync.prepare_next_backwards``).

``fully_shard_model``'s default ``sync_model_each_microbatch=True`` reduces every backward in place
into the accumulated buffer, so gradient accumulation needs it False; together with
``overlap_grad_reduce=False`` under ``optim`` Megatron-FSDP reduces twice in the backward, and the
wrapper refuses that module (``grad_sync.check_sync_settings``).

``MegatronFSDP`` modules are recognised by ``isinstance`` against both copies of the class and
megatron-core's ``FullyShardedDataParallel`` wrapper
(``megatron_muon.common.megatron_fsdp_compat``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.optimizer.optimizer import MegatronOptimizer

from megatron_muon.common.console import print_rank_0
from megatron_muon.common.megatron_fsdp_compat import megatron_fsdp_classes
from megatron_muon.engine.layout import local_tensor
from megatron_muon.fsdp.grad_sync import (
    check_sync_settings,
    finish_grad_sync_once,
    prepare_next_backwards,
)
from megatron_muon.fsdp.qk_clip import QKClip, QKClipStats

__all__ = ["FsdpStepWrapper"]


class FsdpStepWrapper(MegatronOptimizer):
    """Runs the Megatron-FSDP step contract around ``inner`` (a ``ChainedOptimizer``).

    Everything Megatron-LM's training loop uses (``param_groups``, ``zero_grad``,
    ``get_loss_scale``, ``scale_loss``, ``count_zeros``, ``state_dict``, ``load_state_dict``,
    ``sharded_state_dict``, ``reload_model_params``, ``is_stub_optimizer``, ``chained_optimizers``,
    ...) is delegated to ``inner``; ``step()`` returns ``inner.step()``'s
    ``(update_successful, grad_norm, num_zeros_in_grad)``.

    Args:
        inner: the chained optimizer over the FSDP modules' optimizer params.
        fsdp_modules: the ``MegatronFSDP`` modules (one per model chunk).
        grads_already_synced: True when the training loop calls ``finish_grad_sync()`` itself
            before ``step()`` (Megatron-LM's ``finalize_model_grads``); False (default) makes
            ``step()`` reduce the gradients once (a custom loop: forward, backward,
            ``optimizer.step()``; see the module docstring).
        qk_clip: MuonClip's ``QKClip`` over the model's attention layers, built on the optimizer
            params (row shards) before the first forward; ``clip()`` runs after every inner step
            and its ``QKClipStats`` is kept in ``last_qk_clip``; a step that clipped heads prints
            ``QK-clip: N heads clipped ...`` on rank 0 (at any logging level). None: no QK-clip.
        routing: where each param went (the factory's ``RoutedParam`` list), kept as ``routing``.
        summary_lines: the lines the factory printed at build time, kept as ``summary_lines``.
    """

    def __init__(
        self,
        inner: MegatronOptimizer,
        fsdp_modules: Sequence[Any],
        *,
        grads_already_synced: bool = False,
        qk_clip: QKClip | None = None,
        routing: Sequence[Any] = (),
        summary_lines: Sequence[str] = (),
    ) -> None:
        classes = megatron_fsdp_classes()
        for module in fsdp_modules:
            if not isinstance(module, classes):
                raise TypeError(
                    f"FsdpStepWrapper needs MegatronFSDP modules, got {type(module).__name__}"
                )
            check_sync_settings(module)
            if not grads_already_synced:
                prepare_next_backwards(module)
        super().__init__(inner, inner.config)
        self.inner = inner
        self.fsdp_modules = list(fsdp_modules)
        self.grads_already_synced = grads_already_synced
        self.qk_clip = qk_clip
        #: The last step's QK-clip (heads clipped, largest max logit); None before or without it.
        self.last_qk_clip: QKClipStats | None = None
        #: Where each param went and the lines printed at build time (given by the factory).
        self.routing: list[Any] = list(routing)
        self.summary_lines: list[str] = list(summary_lines)

    # ----------------------------------------------------------------------------------------------
    # the step
    # ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, float | None]:
        """Gradients reduced once -> inner step -> QK-clip -> install weights + sync.

        Collective: every rank must call it.

        Raises:
            RuntimeError: ``grads_already_synced=True`` but a backward ran after the loop's last
                ``finish_grad_sync()``.
        """
        for module in self.fsdp_modules:
            if not self.grads_already_synced:
                finish_grad_sync_once(module)
            elif module.microbatch_count:
                raise RuntimeError(
                    f"grads_already_synced=True, but {module.microbatch_count} backward pass(es) "
                    "ran since the last finish_grad_sync(): their gradients are not reduced. Call "
                    "finish_grad_sync() on every chunk before step() (Megatron-LM's "
                    "finalize_model_grads does), or build with grads_already_synced=False"
                )
        self._give_empty_shards_a_grad()
        result = self.inner.step()
        # A skipped step (non-finite grad norm, on every rank) leaves the weights as they were;
        # the logits recorded since the last clip then count toward the next one.
        if self.qk_clip is not None and result[0]:
            # On the main weights' row shards, before they are installed into the compute weights.
            self.last_qk_clip = self.qk_clip.clip()
            if self.last_qk_clip.num_clipped_heads:
                print_rank_0(
                    f"QK-clip: {self.last_qk_clip.num_clipped_heads} heads clipped "
                    f"(max logit {self.last_qk_clip.max_logit:.4g}, "
                    f"threshold {self.qk_clip.threshold:g})"
                )
        for module in self.fsdp_modules:
            module.install_optimized_model_weights()
            module.start_param_sync()
        return result

    def _give_empty_shards_a_grad(self) -> None:
        """A param with 0 local rows has ``grad is None`` on that rank: give it an empty grad.

        torch's AdamW skips params without a grad, so the per-param ``step`` count would stop on
        ranks that hold no rows of a param and checkpoints would differ across ranks (DCP keeps
        one rank's copy of such a replicated value). An empty grad changes no value; Muon already
        treats such ranks this way.
        """
        for param in self.inner.get_parameters():
            if param.grad is None and local_tensor(param).numel() == 0:
                param.grad = torch.zeros_like(param)

    # ----------------------------------------------------------------------------------------------
    # delegation to the chained optimizer
    # ----------------------------------------------------------------------------------------------

    @property
    def chained_optimizers(self) -> list[MegatronOptimizer]:
        """The inner ``ChainedOptimizer``'s sub-optimizers."""
        return self.inner.chained_optimizers

    @property
    def is_stub_optimizer(self) -> bool:
        return self.inner.is_stub_optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def model_chunks(self) -> list[Any]:
        return self.inner.model_chunks

    def get_parameters(self) -> list[torch.nn.Parameter]:
        return self.inner.get_parameters()

    def prepare_grads(self) -> bool:
        return self.inner.prepare_grads()

    def step_with_ready_grads(self) -> bool:
        return self.inner.step_with_ready_grads()

    def get_grad_norm(self) -> float:
        return self.inner.get_grad_norm()

    def count_zeros(self) -> float:
        return self.inner.count_zeros()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the FSDP gradient buffers and the optimizer params' grads."""
        for module in self.fsdp_modules:
            module.zero_grad_buffer()
        self.inner.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self.inner.get_loss_scale()

    def reload_model_params(self, state_dict: Any = None) -> None:
        self.inner.reload_model_params(state_dict)

    def state_dict(self) -> Any:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self.inner.load_state_dict(state_dict)

    def sharded_state_dict(
        self, model_sharded_state_dict: Any, is_loading: bool = False, **kwargs: Any
    ) -> Any:
        return self.inner.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)

    def offload_to_cpu(self) -> None:
        self.inner.offload_to_cpu()

    def restore_from_cpu(self) -> None:
        self.inner.restore_from_cpu()

    def __getattr__(self, name: str) -> Any:
        # Anything else Megatron reads off its optimizer (save/load_parameter_state, ...).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
