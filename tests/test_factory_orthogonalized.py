"""build_muon_optimizer with each orthogonalized optimizer of emerging-optimizers on a real
Megatron-FSDP GPTModel.

One launch (2 gloo ranks) trains the tiny GPTModel of tests/test_factory.py under megatron-core's
``FullyShardedDataParallel`` (``optim_grads_params``; muon_hyperball also ``no_shard``, spel also
``optim``) for ``STEPS`` steps with each of polargrad, scion, mop, spel, muon_hyperball and
sinkhorn_muon, built from ``OptimizerConfig(optimizer=name)``,
next to a single-process fp32 reference: the emerging-optimizers class itself on the full matrices
+ AdamW (``tests/gpt_parity.py``; its matrices' lr and weight decay as the factory's param groups
give them). fp32 "highest" matmuls on both sides (``OptimizerConfig.<name>_fp32_matmul_prec``,
read as megatron-core reads a class's keywords). sinkhorn_muon's model starts Sinkhorn-normalized
(``init_method``), as SinkhornMuon requires. Params within twice the reduction-order floor
measured in the same launch, losses and grad norms floor-judged (the rule of tests/test_factory.py).

Also: the refusals at build time, on one process.
"""

from __future__ import annotations

import functools
from typing import get_args

import pytest
import torch

from megatron_muon.common.options import OrthogonalizedOptimizerT
from megatron_muon.testing import run_on_ranks
from tests import gpt_parity
from tests.factory_gpt_runs import assert_matches_reference
from tests.gpt_parity import FLOOR_FACTOR, Run
from tests.run_comparison import assert_steps_within_floor

NAMES = get_args(OrthogonalizedOptimizerT)
# (run, optimizer): each under optim_grads_params; the two with whole-weight hooks also under
# another strategy (no_shard: replicated params, their norms counted once; optim: ZeRO-1).
RUNS = [(Run("mcore", "optim_grads_params"), name) for name in NAMES] + [
    (Run("mcore", "no_shard"), "muon_hyperball"),
    (Run("mcore", "optim"), "spel"),
]
STEPS = 3
# AdamW's params beside SinkhornMuon (test_gpt_matches_the_unsharded_class says why).
ADAMW_NOISE_FACTOR = 4.0


def _sinkhorn_init(weight: torch.Tensor) -> None:
    """A random Sinkhorn-normalized weight (what SinkhornMuon requires of its params)."""
    from emerging_optimizers.utils.sinkhorn_mapper import SinkhornMapper

    torch.nn.init.normal_(weight)
    SinkhornMapper()(weight, inplace=True)


class _Reference(gpt_parity.Reference):
    """The emerging-optimizers class ``name`` on the matrices (fp32 "highest"), AdamW on the rest
    (``gpt_parity.Reference``'s routing and AdamW)."""

    def __init__(self, model: torch.nn.Module, *, name: str) -> None:
        from emerging_optimizers import registry

        super().__init__(model)
        matrices = [p for group in self.muon.param_groups for p in group["params"]]
        group = {"params": matrices, "lr": gpt_parity.LR, "weight_decay": gpt_parity.WEIGHT_DECAY}
        optimizer_class = registry.get_optimizer_cls(name)
        self.muon = optimizer_class([group], fp32_matmul_prec="highest")
        self.optimizers = [self.muon, self.adamw]


def _config(name: str):
    config = gpt_parity.optimizer_config(optimizer=name)
    # megatron-core reads a class's keyword ``x`` from ``OptimizerConfig.<name>_x`` when present.
    setattr(config, f"{name}_fp32_matmul_prec", "highest")
    return config


def _train(rank: int, world_size: int) -> list[dict]:
    gpt_parity.init_megatron()
    results = []
    for run, name in RUNS:
        init = (
            dict(init_method=_sinkhorn_init, output_layer_init_method=_sinkhorn_init)
            if name == "sinkhorn_muon"
            else {}
        )
        results.append(
            gpt_parity.train(
                run,
                rank,
                world_size,
                STEPS,
                config=_config(name),
                reference_class=functools.partial(_Reference, name=name),
                **init,
            )
        )
    return results


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return run_on_ranks(_train, 2, timeout=600)


@pytest.mark.multirank
@pytest.mark.parametrize("index", range(len(RUNS)), ids=[f"{n}-{r.strategy}" for r, n in RUNS])
def test_gpt_matches_the_unsharded_class(results, index: int) -> None:
    from emerging_optimizers import registry

    name = RUNS[index][1]
    per_rank = [rank_results[index] for rank_results in results]
    class_name = registry.get_optimizer_cls(name).__name__
    assert any(f"{class_name}[dense]" in line for line in per_rank[0]["summary"])
    if name != "sinkhorn_muon":
        assert_matches_reference(per_rank)
        return
    # Sinkhorn-normalized weights (the embeddings too: ``init_method``) are near-uniform, so
    # activations are near-constant and some LayerNorm biases get near-zero grads, whose
    # reduction-order noise AdamW's m / (sqrt(v) + eps) amplifies: measured, pre_mlp_layernorm.bias
    # deviates 9.9e-5 (its own floor 4.9e-5, the largest) while SinkhornMuon's matrices deviate
    # 1.0x their floors (1.6e-7 to 2.7e-7). The class's matrices keep the rule; AdamW's params
    # get ``ADAMW_NOISE_FACTOR``; losses and grad norms floor-judged as the rule.
    routed = {gpt_parity._strip(n): optimizer for n, optimizer, _ in per_rank[0]["routing"]}
    floor = max(per_rank[0]["floor"].values())
    for param, error in gpt_parity.relative_errors([r["deviations"] for r in per_rank]).items():
        factor = FLOOR_FACTOR if routed[param] == name else ADAMW_NOISE_FACTOR
        assert error <= factor * floor, (param, error, floor)
    for rank, result in enumerate(per_rank):
        assert_steps_within_floor(f"{name} rank {rank}", result["stats"])


def test_megatron_cores_own_build_of_these_names_fails() -> None:
    """Why the factory reads the keywords itself: megatron-core 0.19.2 adds Adam's ``betas``."""
    from megatron.core.optimizer.emerging_optimizers import _create_emerging_optimizer

    matrix = [torch.nn.Parameter(torch.ones(4, 4))]
    for name in NAMES:
        with pytest.raises(TypeError, match="betas"):
            _create_emerging_optimizer(_config(name), matrix, name, None, None)


def test_what_cannot_run_exactly_on_row_shards_is_refused_naming_it() -> None:
    from megatron_muon.engine.config import MuonFsdpConfig
    from megatron_muon.optimizers.orthogonalized_adapters import SHARDED_ORTHOGONALIZED as BY_NAME

    matrix = [torch.nn.Parameter(torch.ones(4, 4))]
    with pytest.raises(ValueError, match="not a matrix; PolarGrad takes 2-D params only"):
        BY_NAME["polargrad"]([torch.nn.Parameter(torch.ones(2, 4, 4))])
    with pytest.raises(ValueError, match="ns_method='gram' chooses Muon's Newton-Schulz; Spel"):
        BY_NAME["spel"](matrix, fsdp=MuonFsdpConfig(ns_method="gram"))
    with pytest.raises(TypeError, match="spectral_radius"):  # the class checks its keywords
        BY_NAME["polargrad"](matrix, spectral_radius=2.0)
    with pytest.raises(ValueError, match="param 0 of shape \\(4, 4\\) has norm 0"):
        BY_NAME["muon_hyperball"]([torch.nn.Parameter(torch.zeros(4, 4))])
    with pytest.raises(ValueError, match="param 0 of shape \\(4, 4\\) is not Sinkhorn-normalized"):
        BY_NAME["sinkhorn_muon"](matrix)
    with pytest.raises(ValueError, match="param 0 of shape \\(4, 4\\) has negative values"):
        BY_NAME["sinkhorn_muon"]([torch.nn.Parameter(-torch.ones(4, 4))])
