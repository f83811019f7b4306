"""megatron-core 0.19.2's ``--optimizer lion`` reads ``--lion-beta1`` / ``--lion-beta2`` again.

``get_megatron_optimizer`` sends every optimizer but adam and sgd to its emerging-optimizer path,
where ``lion`` is a default registry entry (``_EMERGING_OPTIMIZERS["lion"]``, no
``config_to_kwargs``): its constructor keywords come from
``_default_adam_based_eopt_config_to_kwargs``, which sets ``betas=(adam_beta1, adam_beta2)``.
So ``--optimizer lion`` steps with Adam's betas (0.9, 0.999 by default) and ignores
``--lion-beta1`` / ``--lion-beta2`` (0.95, 0.98), which its help and ``OptimizerConfig`` document
as Lion's, and which the same megatron-core uses for Lion as ``--muon-scalar-optimizer lion``
(``_get_megatron_optimizer_based_on_param_groups``). ``patch()`` gives the entry a
``config_to_kwargs`` with the Lion betas, everything else as before; megatron-muon's Lion on
Megatron-FSDP (``fsdp.factory``) builds the same ``Lion(lr, (lion_beta1, lion_beta2),
weight_decay)``, so ``--optimizer lion`` means one thing with and without Megatron-FSDP.
``install()`` calls it under its megatron-core version check.
"""

from __future__ import annotations

from typing import Any

__all__ = ["patch", "lion_config_to_kwargs"]


def lion_config_to_kwargs(
    config: Any, model_chunks: Any = None, pg_collection: Any = None
) -> dict[str, Any]:
    """emerging-optimizers ``Lion`` keywords of megatron-core's default entry, betas from
    ``config.lion_beta1`` / ``config.lion_beta2`` (``OptimizerConfig``)."""
    from megatron.core.optimizer import emerging_optimizers

    kwargs = emerging_optimizers._default_adam_based_eopt_config_to_kwargs(
        "lion", config, model_chunks, pg_collection
    )
    kwargs["betas"] = (config.lion_beta1, config.lion_beta2)
    return kwargs


def patch() -> None:
    """Sets ``lion_config_to_kwargs`` on megatron-core's ``lion`` entry (idempotent; nothing
    without emerging-optimizers, where megatron-core has no ``lion`` entry)."""
    from megatron.core.optimizer import emerging_optimizers

    entry = emerging_optimizers._EMERGING_OPTIMIZERS.get("lion")
    if entry is not None and entry.config_to_kwargs is None:
        entry.config_to_kwargs = lion_config_to_kwargs
