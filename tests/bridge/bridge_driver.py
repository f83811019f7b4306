"""One Megatron-Bridge ``pretrain`` run of ``examples/bridge_pretrain_gpt.py``'s tiny GPT (tests).

Launched by ``tests/bridge/test_bridge_pretrain.py`` under torchrun; its one argument is a JSON
object, or a list of them run one after another in the same processes (each run starts with a
``BRIDGE_RUN`` line). For a list the driver creates the default process group itself, so that
Bridge keeps it between runs and destroys only its parallel state: a second
``init_process_group`` in the same torchrun processes reads the first one's stale gloo addresses
from torchrun's store (group keys restart at 0) and fails with "Connection refused":

- ``optimizer``: "muon", "dist_muon", "adaptive_muon", "lion" or "adam";
- ``optimizer_fields``: fields set on the optimizer config (e.g. ``adaptive_muon_beta2``);
- ``integration``: false for Bridge's own ``OptimizerConfig``, with
  ``megatron_muon.integrations.megatron_bridge`` never imported (the CPU stand-ins and the
  dataset-helpers fix are then applied directly);
- ``recipe``: the optimizer config from ``muon_fsdp_with_cosine_annealing`` (the helper of
  Bridge's Muon recipes, wrapped);
- ``model``: fields set on the model provider, e.g. ``qk_clip``;
- ``train``: fields set on the training config, e.g. ``micro_batch_size``;
- ``nudge``: true for a floor run (``tests/run_comparison.py``): every fp32 weight one ulp up
  at the start of training (after a load), before the first iteration (``tests/nudge.py``);
- ``refused``: true for a run that must raise (a refused load): every rank prints
  ``BRIDGE_REFUSED``, the exception's class and message on one line, and the launch goes on
  (a run that does not raise prints ``BRIDGE_NOT_REFUSED``);
- the rest: ``tiny_gpt_config``'s keywords.

Rank 0 prints ``BRIDGE_OPTIMIZER`` and the optimizer's class at the start, ``BRIDGE_SUB_OPTIMIZERS``
and a JSON list of its sub-optimizers (class, ``moment2_method``, first param group's ``beta2``,
``eps``, ``betas``) when it is megatron-muon's; after each iteration
``BRIDGE_STEP`` and a JSON object (iteration, ``lm loss``, grad norm at full precision: Bridge's
log rounds the norm); at the end how often Bridge's own ``clip_qk`` ran
(``BRIDGE_CLIP_QK_CALLS``). Every rank prints the end marker.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "examples")]
STEP_MARKER = "BRIDGE_STEP "
OPTIMIZER_MARKER = "BRIDGE_OPTIMIZER "
SUB_OPTIMIZERS_MARKER = "BRIDGE_SUB_OPTIMIZERS "
RUN_MARKER = "BRIDGE_RUN "
REFUSED_MARKER = "BRIDGE_REFUSED "
INTEGRATION = "megatron_muon.integrations.megatron_bridge"


def _without_integration() -> None:
    """What the integration's ``install()`` applies and a stock Bridge run needs on this machine."""
    from megatron_muon import cpu_stand_ins
    from megatron_muon.integrations import megatron_lm

    cpu_stand_ins.install_for_bridge()
    megatron_lm.use_shipped_dataset_helpers()
    import megatron.bridge.training.initialize as initialize
    import megatron.core.datasets.utils as datasets_utils

    initialize.compile_helpers = datasets_utils.compile_helpers


def _optimizer_config(spec: dict[str, Any]) -> Any:
    from bridge_pretrain_gpt import tiny_gpt_optimizer

    if not spec.get("integration", True):
        return tiny_gpt_optimizer(spec["optimizer"])
    from megatron_muon.integrations.megatron_bridge import (
        MuonFsdpOptimizerConfig,
        muon_fsdp_with_cosine_annealing,
    )

    if not spec.get("recipe"):
        config = MuonFsdpOptimizerConfig.from_config(tiny_gpt_optimizer(spec["optimizer"]))
        for name, value in spec.get("optimizer_fields", {}).items():
            setattr(config, name, value)
        return config
    optimizer, _ = muon_fsdp_with_cosine_annealing(
        precision="fp32",
        max_lr=1e-2,
        min_lr=1e-3,
        weight_decay=0.01,
        muon_use_nesterov=False,
        muon_fp32_matmul_prec="highest",
        lr_warmup_iters=1,
        lr_decay_iters=spec["train_iters"],
    )
    return optimizer


_CLIP_QK_CALLS = [0]


def _count_bridge_clip_qk() -> None:
    """Counts calls of Bridge's ``train.clip_qk`` (wrapped before the integration wraps it)."""
    import megatron.bridge.training.train as train

    clip_qk = train.clip_qk

    def counted(*args: Any, **kwargs: Any) -> Any:
        _CLIP_QK_CALLS[0] += 1
        return clip_qk(*args, **kwargs)

    train.clip_qk = counted


def _sub_optimizers(optimizer: Any) -> list[dict[str, Any]]:
    """Each sub-optimizer's class and the settings its first param group holds."""
    found = []
    for sub in getattr(optimizer, "chained_optimizers", []):
        inner = sub.optimizer
        group = inner.param_groups[0]
        found.append(
            {
                "class": type(inner).__name__,
                "moment2_method": getattr(inner, "moment2_method", None),
                **{key: group[key] for key in ("beta2", "eps", "betas") if key in group},
            }
        )
    return found


def main() -> None:
    specs = json.loads(sys.argv[1])
    specs = specs if isinstance(specs, list) else [specs]
    _count_bridge_clip_qk()
    if any(not spec.get("integration", True) for spec in specs):
        _without_integration()
    if len(specs) > 1:
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    for index, spec in enumerate(specs):
        _run(index, spec)
    imported = INTEGRATION in sys.modules
    print(f"BRIDGE_INTEGRATION_IMPORTED {json.dumps(imported)}", flush=True)
    from tests.torchrun import DONE_MARKER

    print(DONE_MARKER, flush=True)


def _run(index: int, spec: dict[str, Any]) -> None:
    """Bridge's ``pretrain`` of ``spec`` (module docstring)."""
    print(f"{RUN_MARKER}{index}", flush=True)
    _CLIP_QK_CALLS[0] = 0
    from bridge_pretrain_gpt import tiny_gpt_config
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from tests.nudge import nudge_weights

    class Record(Callback):  # type: ignore[misc]
        def on_train_start(self, context: Any) -> None:
            if spec.get("nudge"):  # every rank, its own shards
                nudge_weights(context.model)
            if torch.distributed.get_rank() == 0:
                print(OPTIMIZER_MARKER + type(context.optimizer).__name__, flush=True)
                subs = _sub_optimizers(context.optimizer)
                print(SUB_OPTIMIZERS_MARKER + json.dumps(subs), flush=True)

        def on_train_step_end(self, context: Any) -> None:
            if torch.distributed.get_rank() == 0:
                step = {
                    "iteration": context.state.train_state.step,
                    "lm loss": float(context.loss_dict["lm loss"]),
                    "grad norm": float(context.grad_norm),
                }
                print(STEP_MARKER + json.dumps(step), flush=True)

    own = (
        "optimizer",
        "optimizer_fields",
        "integration",
        "recipe",
        "model",
        "train",
        "nudge",
        "refused",
    )
    cfg = tiny_gpt_config(
        _optimizer_config(spec), **{k: v for k, v in spec.items() if k not in own}
    )
    for name, value in spec.get("model", {}).items():
        setattr(cfg.model, name, value)
    for name, value in spec.get("train", {}).items():
        setattr(cfg.train, name, value)
    if spec.get("refused"):
        try:
            pretrain(cfg, forward_step, callbacks=[Record()])
        except Exception as error:  # noqa: BLE001 - the test reads which one, on every rank
            message = " ".join(str(error).split())
            print(f"{REFUSED_MARKER}{type(error).__name__}: {message}", flush=True)
        else:
            print("BRIDGE_NOT_REFUSED", flush=True)
        return
    pretrain(cfg, forward_step, callbacks=[Record()])
    print(f"BRIDGE_CLIP_QK_CALLS {_CLIP_QK_CALLS[0]}", flush=True)


if __name__ == "__main__":
    main()
