"""build_muon_optimizer with LaProp, ObliqueSGD and ObliqueAdam on a real Megatron-FSDP GPTModel.

One launch (2 gloo ranks) trains the tiny GPTModel of tests/test_factory.py under megatron-core's
``FullyShardedDataParallel`` (``optim_grads_params``: uneven row shards, some empty) for ``STEPS``
steps with each, built from ``OptimizerConfig(optimizer=name)`` (ObliqueSGD normalizing rows
too, ``oblique_sgd_dim = 1``, a setting a custom trainer puts on the config), next to a
single-process fp32 reference: the emerging-optimizers class itself on the full matrices (lr,
weight decay, ``betas`` from ``adam_beta1/2``, ``momentum`` from ``sgd_momentum``: what the
factory reads) + AdamW (``tests/gpt_parity.py``). The routing is megatron-core's for an emerging
optimizer (2-D params but embeddings and the output layer; AdamW the rest). Params within twice
the reduction-order floor measured in the same launch, losses and grad norms floor-judged (the
rule of tests/test_factory.py); ObliqueAdam also on the MoE GPT (4 experts, their rows and column
sums over ``expt_dp``).
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_muon.testing import run_on_ranks
from tests import gpt_parity
from tests.factory_gpt_runs import assert_matches_reference
from tests.gpt_parity import Run

RUN = Run("mcore", "optim_grads_params")
# (case, registry name, settings put on OptimizerConfig, MoE GPT)
CASES = [
    ("laprop", "laprop", {}, False),
    ("oblique_sgd", "oblique_sgd", {}, False),
    ("oblique_sgd rows", "oblique_sgd", {"oblique_sgd_dim": 1}, False),
    ("oblique_adam", "oblique_adam", {}, False),
    ("oblique_adam moe", "oblique_adam", {}, True),
]
STEPS = 3
SGD_MOMENTUM = 0.8


class _Reference(gpt_parity.Reference):
    """The emerging-optimizers class ``name`` on the matrices, AdamW on the rest."""

    def __init__(self, model: torch.nn.Module, *, name: str, settings: dict) -> None:
        from emerging_optimizers import registry

        super().__init__(model)
        matrices = [p for group in self.muon.param_groups for p in group["params"]]
        group = {"params": matrices, "lr": gpt_parity.LR, "weight_decay": gpt_parity.WEIGHT_DECAY}
        keywords = {key.removeprefix(f"{name}_"): value for key, value in settings.items()}
        if name == "oblique_sgd":
            keywords["momentum"] = SGD_MOMENTUM
        else:
            keywords["betas"] = gpt_parity.BETAS
        self.muon = registry.get_optimizer_cls(name)([group], **keywords)
        self.optimizers = [self.muon, self.adamw]


def _train(rank: int, world_size: int) -> list[dict]:
    gpt_parity.init_megatron()
    results = []
    for _, name, settings, moe in CASES:
        config = gpt_parity.optimizer_config(optimizer=name, sgd_momentum=SGD_MOMENTUM)
        for key, value in settings.items():
            setattr(config, key, value)  # megatron-core reads <name>_<keyword> where set
        reference = functools.partial(_Reference, name=name, settings=settings)
        results.append(
            gpt_parity.train(
                RUN, rank, world_size, STEPS, moe, config=config, reference_class=reference
            )
        )
    return results


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return run_on_ranks(_train, 2, timeout=600)


@pytest.mark.multirank
@pytest.mark.parametrize("index", range(len(CASES)), ids=[case for case, *_ in CASES])
def test_gpt_matches_the_unsharded_class(results, index: int) -> None:
    from megatron_muon.fsdp.rowwise_optimizers import ROWWISE_OPTIMIZERS

    _, name, settings, moe = CASES[index]
    per_rank = [rank_results[index] for rank_results in results]
    summary = per_rank[0]["summary"]
    label = ROWWISE_OPTIMIZERS[name].label
    assert summary[0].startswith(f"megatron-muon {label}[dense]:"), summary
    for key, value in settings.items():
        assert f"{key.removeprefix(name + '_')}={value}" in summary[0], summary
    routing = per_rank[0]["routing"]
    assert {optimizer for _, optimizer, _ in routing} == {name, "adam"}, routing
    if moe:
        assert any(line.startswith(f"megatron-muon {label}[expert]:") for line in summary)
        assert {o for n, o, is_expert in routing if ".experts." in n} == {name}, routing
    assert_matches_reference(per_rank)
