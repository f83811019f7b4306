"""Megatron-Bridge's ``pretrain`` with ``MuonFsdpOptimizerConfig``: exact across DP, resumable.

Every launch is Bridge's own training loop on CPU/gloo ranks (``tests/bridge/bridge_driver.py``
runs ``examples/bridge_pretrain_gpt.py``'s tiny GPT, 6 iterations), reading each iteration's
loss and grad norm at full precision. megatron-muon's other optimizers (``FsdpOptimizerT``
besides Muon) run in launches the Muon tests make anyway, one after Muon's run in the same
processes: at DP=1 in the reference launch, at DP=2 in one strategy test's launch each
(``SHARED_STRATEGY``), so that each adds two runs and no launch. These tests need
Megatron-Bridge: ``make test-bridge`` runs them in ``.venv-bridge``
(``scripts/setup_bridge_venv.sh``); elsewhere they are skipped.

DP=2 against DP=1 is **floor-judged** (tests/run_comparison.py): the two reduce in other orders
(the gradient reduce over 2 ranks, the loss averaged over 2 x 2 micro-batches instead of 4), so
each iteration's loss and grad norm (full precision, rank 0's) of the DP=2 run is judged against
the DP=1 reference within ``FLOOR_FACTOR`` (10) times the envelope of the reference's floor run
(the same spec again with every fp32 weight one ulp up at the start of training, ``nudge``:
run in the DP=1 reference launch after the references, no launch of its own) plus 4 fp32 ulps.
SOAP and REKLS run with ``SAME_GRADIENT_BITS``: their losses are bitwise those of DP=1 and their
grad norms floor-judged (a norm summed on shards that no update reads), as in
tests/test_megatron_lm_soap.py. Measured on an AVX2-only AMD Zen 3 (2026-12-02), over the 6
iterations: DP=2's losses within one fp32 ulp of DP=1's (<= 1.0e-7 relative) for every
optimizer, where the floor run's losses move by less than an ulp (a floor of 0 for all but
SOAP, REKLS and oblique_sgd: the 4-ulp guard, 4.8e-7, is the bound); grad norms <= 3.0e-7
(Muon under optim_grads and optim_grads_params) against floors of 2.3e-7 (LaProp) to 8.6e-7
(Muon), bounds by the last iteration 1.8e-6 to 6.9e-6; SOAP and REKLS equal to the last bit,
their floors 3.7e-2 (loss) and 0.34 / 1.2 (grad norm) by iteration 5. Teeth: Muon at DP=2 with
a 1% larger peak lr is 1.7e-5 off in loss at iteration 2 (36 times its bound) and 5.8e-4 at
iteration 5; with ``muon_momentum`` 0.94 instead of 0.95, 8.1e-6 and 6.7e-4. The floor runs
double the DP=1 launch (9 runs to 18: 20 s to 43 s, measured back to back on 2 shared cores).

Bitwise (shared arithmetic): a resumed run; Adam with and without the integration; the
``dist_muon`` recipe config against ``"muon"`` with the same settings. In the resumed run's
launch the same Muon checkpoint loaded with Lion is refused on every rank naming both optimizers
(``integrations.checkpoint_guards.bridge``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import pytest

from megatron_muon.common.options import FsdpOptimizerT
from tests.run_comparison import FULL_PRECISION_GUARD, FloorVerdict, assert_within_floor
from tests.torchrun import run_megatron

DRIVER = Path(__file__).with_name("bridge_driver.py")
STEP_MARKER = "BRIDGE_STEP "
OPTIMIZER_MARKER = "BRIDGE_OPTIMIZER "
SUB_OPTIMIZERS_MARKER = "BRIDGE_SUB_OPTIMIZERS "
RUN_MARKER = "BRIDGE_RUN "
REFUSED_MARKER = "BRIDGE_REFUSED "
ITERS = 6
SAVED_AT = 3
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
OURS = "MegatronCheckpointedOptimizer"
# Below every head's max logit of the tiny GPT at its first steps (0.06 to 0.14): heads clip.
QK_CLIP_THRESHOLD = 0.05

# megatron-muon's optimizers besides Muon: a new FsdpOptimizerT value is tested here as it
# appears there. Each runs at DP=2 after Muon in the launch of one of the first three strategy
# tests, in turn from "optim" (optim_grads_params's launch saves the checkpoint that the resume
# test reads, and stays as it is).
EMERGING = tuple(name for name in get_args(FsdpOptimizerT) if name != "muon")
SHARED_STRATEGY = {name: STRATEGIES[(i + 1) % 3] for i, name in enumerate(EMERGING)}
# SOAP's Adam step in an eigenbasis that is arbitrary within nearly equal eigenvalues turns a
# last-bit difference of the gradient into a visible one (docs/internals.md), so its DP=2 and DP=1
# runs must reduce the same gradient bits: one micro-batch per rank at DP=2 (2 at DP=1: the batch
# gradient is g1 + g2 on both sides, the halvings exact) and no clipping (a grad norm summed over
# shards in another order scales every gradient by another last bit).
SAME_GRADIENT_BITS: dict[str, Any] = {"train": {"micro_batch_size": 4}}
SAME_GRADIENT_BITS_FOR = frozenset({"soap", "rekls"})  # REKLS is SOAP with eigh and KL-Shampoo
# Each one's own settings, other than megatron-core's defaults, set on the Bridge config (the
# tests check that they reach the optimizer); Lion at a Lion-sized lr.
OPTIMIZER_FIELDS: dict[str, dict[str, Any]] = {
    "adaptive_muon": {
        "adaptive_muon_moment2_method": "normuon",
        "adaptive_muon_beta2": 0.9,
        "adaptive_muon_eps": 1e-7,
    },
    "lion": {"lion_beta1": 0.9, "lion_beta2": 0.99, "lr": 3e-3, "min_lr": 3e-4},
    "soap": {"clip_grad": 0.0},
    "rekls": {"clip_grad": 0.0},
}

LOSS_FALL = {"soap": 0.05, "rekls": 0.05, "oblique_sgd": 0.2, "oblique_adam": 0.2}

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron.bridge") is None,
        reason="Megatron-Bridge is not installed here: `make test-bridge` runs these tests in "
        ".venv-bridge (scripts/setup_bridge_venv.sh)",
    ),
]

_CHECKPOINTS = Path(tempfile.mkdtemp(prefix="mm_bridge_ckpt_"))


@dataclass(frozen=True)
class BridgeRun:
    """What rank 0 printed during one ``pretrain`` of a launch (``output``), and every rank
    (``rank_outputs``, rank 0's first)."""

    output: str
    rank_outputs: tuple[str, ...]


@functools.cache
def _launch(specs_json: str, nproc: int) -> tuple[BridgeRun, ...]:
    run = run_megatron(
        [specs_json], nproc=nproc, timeout=300, entry=[str(DRIVER)], entry_prints_done_marker=True
    )
    count = len(json.loads(specs_json))
    print(f"\nBridge launch of {count} runs on {nproc} ranks: {run.wall_s:.1f} s")
    # Before the first run: the launch's start; the last run's part ends with the launch's end.
    parts = [
        re.split(rf"^{RUN_MARKER}\d+$", run.rank_outputs[rank], flags=re.MULTILINE)[1:]
        for rank in range(nproc)
    ]
    return tuple(BridgeRun(runs[0], tuple(runs)) for runs in zip(*parts, strict=True))


def bridge_runs(nproc: int, *specs: dict[str, Any]) -> tuple[BridgeRun, ...]:
    """One launch (cached: several tests read the same runs) of ``specs`` on ``nproc`` ranks, one
    ``pretrain`` after another."""
    full = [{"optimizer": "muon", "train_iters": ITERS, **spec} for spec in specs]
    runs = _launch(json.dumps(full, sort_keys=True), nproc)
    assert len(runs) == len(specs), "a BRIDGE_RUN line per spec"
    return runs


def bridge_run(nproc: int = 2, **spec: Any) -> BridgeRun:
    """One launch of one ``spec`` on ``nproc`` ranks."""
    return bridge_runs(nproc, spec)[0]


def emerging_spec(name: str) -> dict[str, Any]:
    spec = {"optimizer": name, "optimizer_fields": OPTIMIZER_FIELDS.get(name, {})}
    return spec | (SAME_GRADIENT_BITS if name in SAME_GRADIENT_BITS_FOR else {})


def _dp1_launch() -> tuple[dict[str, BridgeRun], dict[str, BridgeRun]]:
    """One launch: the DP=1 references, Muon's and each of ``EMERGING``'s, then each again as
    its floor run (``nudge``). Returns (references, floor runs) by optimizer name."""
    names = ("muon", *EMERGING)
    references = [{}, *(emerging_spec(name) for name in EMERGING)]
    runs = bridge_runs(1, *references, *({**spec, "nudge": True} for spec in references))
    return dict(zip(names, runs[: len(names)], strict=True)), dict(
        zip(names, runs[len(names) :], strict=True)
    )


def dp1_runs() -> dict[str, BridgeRun]:
    """The DP=1 references by optimizer name (``_dp1_launch``)."""
    return _dp1_launch()[0]


def dp1_floors() -> dict[str, BridgeRun]:
    """The DP=1 references' floor runs by optimizer name (``_dp1_launch``)."""
    return _dp1_launch()[1]


def strategy_runs(strategy: str) -> dict[str, BridgeRun]:
    """Muon at DP=2 under ``strategy`` (not optim_grads_params), then the ``EMERGING`` optimizers
    sharing this launch (``SHARED_STRATEGY``), from one launch."""
    names = ("muon", *(name for name in EMERGING if SHARED_STRATEGY[name] == strategy))
    specs = [{}] + [emerging_spec(name) for name in names[1:]]
    specs = [{**spec, "data_parallel_sharding_strategy": strategy} for spec in specs]
    return dict(zip(names, bridge_runs(2, *specs), strict=True))


def steps(run: BridgeRun) -> list[dict[str, float]]:
    """Rank 0's ``BRIDGE_STEP`` objects, in iteration order."""
    lines = run.output.splitlines()
    found = [json.loads(line[len(STEP_MARKER) :]) for line in lines if line.startswith(STEP_MARKER)]
    return sorted(found, key=lambda step: step["iteration"])


def marked(run: BridgeRun, marker: str) -> str:
    """The rest of rank 0's first line starting with ``marker``."""
    return next(line[len(marker) :] for line in run.output.splitlines() if line.startswith(marker))


def optimizer_class(run: BridgeRun) -> str:
    return marked(run, OPTIMIZER_MARKER)


def sub_optimizers(run: BridgeRun) -> list[dict[str, Any]]:
    """The driver's ``BRIDGE_SUB_OPTIMIZERS``: class and settings of each sub-optimizer."""
    return json.loads(marked(run, SUB_OPTIMIZERS_MARKER))


def uninterrupted_run() -> BridgeRun:
    """DP=2, optim_grads_params, saving at iteration 3 on its way to 6."""
    return bridge_run(save=str(_CHECKPOINTS / "muon"), save_interval=SAVED_AT)


def series(run: BridgeRun, key: str) -> dict[int, float]:
    """{iteration: ``key``} of rank 0's ``BRIDGE_STEP`` objects (``"lm loss"``, ``"grad norm"``)."""
    return {step["iteration"]: step[key] for step in steps(run)}


def assert_within_dp1_floor(label: str, run: BridgeRun, name: str) -> list[FloorVerdict]:
    """``run``'s losses and grad norms against the DP=1 reference of optimizer ``name``, each
    within the floor of that reference's floor run (module docstring); prints the verdicts."""
    reference, floor = dp1_runs()[name], dp1_floors()[name]
    assert [s["iteration"] for s in steps(run)] == [s["iteration"] for s in steps(reference)]
    return [
        assert_within_floor(
            f"{label} {key}",
            series(run, key),
            series(reference, key),
            series(floor, key),
            guard=FULL_PRECISION_GUARD,
        )
        for key in ("lm loss", "grad norm")
    ]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_muon_at_dp2_equals_dp1_under_each_sharding_strategy(strategy: str) -> None:
    reference = steps(dp1_runs()["muon"])
    run = (
        uninterrupted_run() if strategy == "optim_grads_params" else strategy_runs(strategy)["muon"]
    )
    assert optimizer_class(run) == OURS
    assert len(reference) == ITERS
    assert_within_dp1_floor(f"muon {strategy} DP=2 vs DP=1", run, "muon")
    losses = [s["lm loss"] for s in steps(run)]
    assert losses[-1] < losses[0] - 0.5, losses


def loads_of_the_muon_checkpoint() -> tuple[BridgeRun, BridgeRun]:
    """One launch: Muon resumed from ``uninterrupted_run``'s checkpoint at ``SAVED_AT``, then
    Lion loading the same checkpoint (refused: ``checkpoint_guards.bridge``)."""
    uninterrupted_run()  # saves the checkpoint
    loading = {"load": str(_CHECKPOINTS / "muon"), "ckpt_step": SAVED_AT}
    resumed, lion = bridge_runs(2, loading, {**emerging_spec("lion"), **loading, "refused": True})
    return resumed, lion


def test_resume_from_fsdp_dtensor_checkpoint_continues_the_run_bitwise() -> None:
    uninterrupted = steps(uninterrupted_run())
    resumed = steps(loads_of_the_muon_checkpoint()[0])
    assert [s["iteration"] for s in resumed] == list(range(SAVED_AT, ITERS))
    assert resumed == uninterrupted[SAVED_AT:]


def test_a_muon_checkpoint_loaded_with_lion_is_refused_on_every_rank_naming_both() -> None:
    lion = loads_of_the_muon_checkpoint()[1]
    directory = _CHECKPOINTS / "muon" / f"iter_{SAVED_AT:07d}"
    refusal = (
        f"{REFUSED_MARKER}CheckpointMismatchError: checkpoint.load='{_CHECKPOINTS / 'muon'}': "
        f"checkpoint {directory} (saved by optimizer='muon') holds optimizer state "
        "['exp_avg', 'exp_avg_sq', 'momentum_buffer', 'step'], this run's optimizer='lion' keeps "
        "['exp_avg', 'exp_avg_sq', 'step'] (saved by a run with another optimizer?). "
        "Set checkpoint.load_optim=False to load the weights alone"
    )
    for rank, output in enumerate(lion.rank_outputs):
        assert refusal in output, (rank, output[-3000:])
        assert STEP_MARKER not in output, rank  # refused before training


def test_dist_muon_recipe_config_trains_megatron_muon() -> None:
    """Bridge's Muon recipes make ``optimizer="dist_muon"`` (``distributed_muon_with_cosine_
    annealing``); through ``muon_fsdp_with_cosine_annealing`` it is megatron-muon's Muon, the same
    updates as ``"muon"`` with the same settings: bitwise (the same layout, the same arithmetic)."""
    run = bridge_run(recipe=True, optimizer="dist_muon")
    assert optimizer_class(run) == OURS
    assert "megatron-muon Muon[dense]" in run.output
    assert len(steps(run)) == ITERS
    assert steps(run) == steps(uninterrupted_run())


def test_adam_logs_the_same_lines_with_and_without_the_integration() -> None:
    stock = bridge_run(optimizer="adam", integration=False)
    ours = bridge_run(optimizer="adam", save=str(_CHECKPOINTS / "adam"), save_interval=ITERS)
    assert "BRIDGE_INTEGRATION_IMPORTED false" in stock.output
    assert "BRIDGE_INTEGRATION_IMPORTED true" in ours.output
    assert len(steps(stock)) == ITERS
    assert steps(ours) == steps(stock)
    # Stock Bridge + Adam hangs in this save at DP=2 (a rank without rows of a param has no lazy
    # Adam state); with the integration every param's state exists on every rank before it.
    assert (_CHECKPOINTS / "adam" / f"iter_{ITERS:07d}").is_dir()


def test_model_qk_clip_runs_megatron_muon_clip_and_skips_bridges_clip_qk() -> None:
    """The model's ``qk_clip`` (Bridge's MuonClip switch) with our Muon: megatron-muon's ``QKClip``
    clips the main weights' row shards after each step; Bridge's ``clip_qk`` (compute weights)
    must not run on top of it."""
    run = bridge_run(model={"qk_clip": True, "qk_clip_threshold": QK_CLIP_THRESHOLD})
    output = run.output
    assert f"megatron-muon QK-clip: threshold {QK_CLIP_THRESHOLD} on 2 attention layers" in output
    clipped = [int(n) for n in re.findall(r"^QK-clip: (\d+) heads clipped", output, re.MULTILINE)]
    assert len(clipped) == ITERS and all(clipped), clipped
    assert "BRIDGE_CLIP_QK_CALLS 0" in output
    losses = [s["lm loss"] for s in steps(run)]
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("name", EMERGING)
def test_emerging_optimizer_at_dp2_equals_dp1(name: str) -> None:
    """Each of megatron-muon's other optimizers, from ``MuonFsdpOptimizerConfig(optimizer=name)``,
    trains megatron-muon's sharded optimizer through Bridge's loop, at DP=2 (under
    ``SHARED_STRATEGY[name]``) within the floor of DP=1 (module docstring; SOAP and REKLS with
    ``SAME_GRADIENT_BITS``: their losses bitwise)."""
    reference = dp1_runs()[name]
    run = strategy_runs(SHARED_STRATEGY[name])[name]
    for each in (reference, run, dp1_floors()[name]):
        assert optimizer_class(each) == OURS
        assert len(steps(each)) == ITERS
    assert_within_dp1_floor(f"{name} DP=2 vs DP=1", run, name)
    if name in SAME_GRADIENT_BITS_FOR:
        assert series(run, "lm loss") == series(reference, "lm loss")
    losses = [s["lm loss"] for s in steps(run)]
    # SOAP (and REKLS) at megatron-core's default settings fall slowly in 6 iterations (5.54 to
    # 5.47 here), the oblique classes (unit-norm rows or columns) by 0.37 (5.54 to 5.17).
    assert losses[-1] < losses[0] - LOSS_FALL.get(name, 0.5), losses


def test_adaptive_muon_takes_its_moment2_settings_from_the_bridge_config() -> None:
    """``adaptive_muon_moment2_method`` / ``_beta2`` / ``_eps`` of the Bridge config (megatron-core
    ``OptimizerConfig`` fields) are those of the ``ShardedAdaptiveMuon`` that steps."""
    fields = OPTIMIZER_FIELDS["adaptive_muon"]
    dp2 = strategy_runs(SHARED_STRATEGY["adaptive_muon"])["adaptive_muon"]
    for run in (dp1_runs()["adaptive_muon"], dp2):
        assert sub_optimizers(run)[0] == {
            "class": "ShardedAdaptiveMuon",
            "moment2_method": fields["adaptive_muon_moment2_method"],
            "beta2": fields["adaptive_muon_beta2"],
            "eps": fields["adaptive_muon_eps"],
        }
        assert "megatron-muon AdaptiveMuon(normuon)[dense]: 8 params" in run.output


def test_lion_takes_its_betas_from_the_bridge_config() -> None:
    run = strategy_runs(SHARED_STRATEGY["lion"])["lion"]
    fields = OPTIMIZER_FIELDS["lion"]
    lion, rest = sub_optimizers(run)
    assert lion["class"] == "Lion"
    assert lion["betas"] == [fields["lion_beta1"], fields["lion_beta2"]]
    assert rest["class"] == "AdamW"
    assert "megatron-muon Lion: 8 params" in run.output
