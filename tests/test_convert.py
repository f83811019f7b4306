"""``python -m megatron_muon.convert`` on hand-built checkpoints, one process: the key mapping of
both formats (the names measured from Megatron-LM's own saves, docs/checkpoints.md), a round trip
torch_dist -> fsdp_dtensor -> torch_dist bitwise (Adam; megatron-core's LayerWise Muon and ours),
and each refusal named.

The checkpoints here are written by the converter's own writers from a tiny GPT's model-space
tensors (2 layers, hidden 8, the local spec, swiglu); the multi-rank test
(tests/test_megatron_lm_convert.py) converts checkpoints Megatron-LM itself saved and continues
them in its loop.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from megatron_muon.convert import ConversionRefused, ModelSpace, convert, names
from megatron_muon.convert.dcp_files import DcpFiles, write_checkpoint
from megatron_muon.convert.fsdp_dtensor import fsdp_dtensor_values, read_fsdp_dtensor
from megatron_muon.convert.torch_dist import COMMON_KEY, read_torch_dist, torch_dist_values

HIDDEN, FFN, LAYERS = 8, 16, 2
_LAYER_SHAPES = {
    "input_layernorm.weight": (HIDDEN,),
    "input_layernorm.bias": (HIDDEN,),
    "self_attention.linear_qkv.weight": (3 * HIDDEN, HIDDEN),
    "self_attention.linear_qkv.bias": (3 * HIDDEN,),
    "self_attention.linear_proj.weight": (HIDDEN, HIDDEN),
    "pre_mlp_layernorm.weight": (HIDDEN,),
    "mlp.linear_fc1.weight": (2 * FFN, HIDDEN),  # swiglu: gate rows, then up rows
    "mlp.linear_fc2.weight": (HIDDEN, FFN),
}


def _args(**overrides: object) -> argparse.Namespace:
    values = dict(
        optimizer="adam",
        num_layers=LAYERS,
        transformer_impl="local",
        swiglu=True,
        pipeline_model_parallel_size=1,
        tensor_model_parallel_size=2,
        num_experts=None,
        multi_latent_attention=False,
        bf16=False,
        fp16=False,
        decoupled_lr=None,
        apply_wd_to_qk_layernorm=False,
        ckpt_format="torch_dist",
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def _group(wd_mult: float) -> dict[str, object]:
    fields = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "max_lr": 1e-3, "min_lr": 0.0}
    return {**fields, "wd_mult": wd_mult, "lr_mult": 1.0, "weight_decay": 0.1 * wd_mult}


def _space(**overrides: object) -> ModelSpace:
    generator = torch.Generator().manual_seed(0)
    shapes = {
        "embedding.word_embeddings.weight": (32, HIDDEN),
        "decoder.final_layernorm.weight": (HIDDEN,),
    }
    for layer in range(LAYERS):
        shapes |= {f"decoder.layers.{layer}.{rest}": s for rest, s in _LAYER_SHAPES.items()}

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    params = {name: draw(shape) for name, shape in shapes.items()}
    state = {
        n: {"exp_avg": draw(p.shape), "exp_avg_sq": draw(p.shape).abs()} for n, p in params.items()
    }
    groups = {
        n: _group(0.0 if names.no_weight_decay(n, p.ndim) else 1.0) for n, p in params.items()
    }
    return ModelSpace(
        params=params,
        state=state,
        steps={name: 7.0 for name in params},
        groups=groups,
        scheduler={"max_lr": 1e-3, "num_steps": 28, "lr_decay_style": "constant"},
        args=_args(**overrides),
        iteration=7,
        flops=1.5e9,
        checkpoint_version=3.0,
    )


def _saved_torch_dist(tmp_path: Path, space: ModelSpace, **common: object) -> Path:
    values = torch_dist_values(space)
    values[COMMON_KEY][0]["optimizer"].update(common)
    directory = tmp_path / "torch_dist" / "iter_0000007"
    write_checkpoint(str(directory), values)
    return directory


def test_torch_dist_keys_are_megatrons_stacked_layers_with_the_local_specs_norm_names(
    tmp_path: Path,
) -> None:
    space = _space()
    files = DcpFiles(str(_saved_torch_dist(tmp_path, space)))
    keys = {key: tuple(entry.size) for key, entry in files.tensor_keys.items()}
    # The names and shapes Megatron-LM's torch_dist save of the local spec holds (measured).
    assert keys["decoder.layers.self_attention.linear_qkv.layer_norm_weight"] == (LAYERS, HIDDEN)
    assert keys["decoder.layers.mlp.linear_fc1.layer_norm_weight"] == (LAYERS, HIDDEN)
    assert keys["decoder.layers.self_attention.linear_qkv.weight"] == (LAYERS, 3 * HIDDEN, HIDDEN)
    fc1_exp_avg = keys["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"]
    assert fc1_exp_avg == (LAYERS, 2 * FFN, HIDDEN)
    assert keys["optimizer.state.param.embedding.word_embeddings.weight"] == (32, HIDDEN)
    assert "decoder.layers.self_attention.linear_proj._extra_state/shard_1_2" in files.object_keys
    stacked = files.tensors(["decoder.layers.mlp.linear_fc1.layer_norm_weight"])
    second_layer = stacked["decoder.layers.mlp.linear_fc1.layer_norm_weight"][1]
    assert torch.equal(second_layer, space.params["decoder.layers.1.pre_mlp_layernorm.weight"])


def test_fsdp_dtensor_keys_are_megatrons_per_param_names_with_swiglu_halves(
    tmp_path: Path,
) -> None:
    space = read_torch_dist(str(_saved_torch_dist(tmp_path, _space())))
    values = fsdp_dtensor_values(space)
    fc1 = space.params["decoder.layers.0.mlp.linear_fc1.weight"]
    # Megatron's handle_swiglu_in_state_dict: _w the gate rows, _v the up rows.
    assert torch.equal(values["model.module.decoder.layers.0.mlp.linear_fc1.weight_w"], fc1[:FFN])
    assert torch.equal(values["model.module.decoder.layers.0.mlp.linear_fc1.weight_v"], fc1[FFN:])
    prefix = "optimizer.state.module.module.decoder.layers.1.input_layernorm.weight."
    assert values[prefix + "step"].dtype == torch.float32 and float(values[prefix + "step"]) == 7.0
    expected = space.state["decoder.layers.1.input_layernorm.weight"]["exp_avg"]
    assert torch.equal(values[prefix + "exp_avg"], expected)
    meta = "optimizer.param_to_group_meta.module.module."
    assert values[meta + "decoder.layers.1.input_layernorm.weight.wd_mult"] == 0.0
    assert values[meta + "decoder.layers.1.self_attention.linear_proj.weight.wd_mult"] == 1.0
    assert values["opt_param_scheduler.num_steps"] == 28 and values["iteration"] == 7
    assert values["args"].ckpt_format == "fsdp_dtensor" and values["args"].use_megatron_fsdp


def test_torch_dist_to_fsdp_dtensor_and_back_is_bitwise(tmp_path: Path) -> None:
    source = _saved_torch_dist(tmp_path, _space())
    lines: list[str] = []
    first = convert("torch_dist", str(source), str(tmp_path / "fsdp"), progress=lines.append)
    assert first.params == len(_space().params) and lines[0].startswith("reading torch_dist")
    second = convert("fsdp_dtensor", str(tmp_path / "fsdp"), str(tmp_path / "back"))
    assert (tmp_path / "back" / "latest_checkpointed_iteration.txt").read_text() == "7"
    print("\n".join([*first.lines(), *second.lines()]))
    before, after = DcpFiles(str(source)), DcpFiles(str(tmp_path / "back" / "iter_0000007"))
    assert sorted(after.tensor_keys) == sorted(before.tensor_keys)
    got, expected = after.tensors(list(after.tensor_keys)), before.tensors(list(before.tensor_keys))
    assert not [key for key in expected if not torch.equal(got[key], expected[key])]
    back = read_fsdp_dtensor(str(tmp_path / "fsdp" / "iter_0000007"))
    assert back.steps == _space().steps and back.scheduler == _space().scheduler


@pytest.mark.parametrize(
    ("overrides", "common", "named"),
    [
        ({"optimizer": "sgd"}, {}, "--optimizer sgd"),
        ({"pipeline_model_parallel_size": 2}, {}, "--pipeline-model-parallel-size 2"),
        ({"num_experts": 4}, {}, "--num-experts 4"),
        ({"bf16": True}, {}, "--bf16"),
        ({}, {"param_state_sharding_type": "dp_reshardable"}, "'dp_reshardable'"),
        ({}, {"param_state_sharding_type": None}, "--use-distributed-optimizer"),
    ],
    ids=["sgd", "pipeline", "experts", "bf16", "dp_reshardable", "no_distributed_optimizer"],
)
def test_a_layout_that_cannot_map_is_refused_by_name_and_nothing_is_written(
    tmp_path: Path, overrides: dict[str, object], common: dict[str, object], named: str
) -> None:
    source = _saved_torch_dist(tmp_path, _space(**overrides), **common)
    with pytest.raises(ConversionRefused, match=named.replace("-", r"\-")):
        convert("torch_dist", str(source), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def _muon_space(**overrides: object) -> ModelSpace:
    """``_space`` as a Muon run holds it: each matrix (2-D, no embedding) Muon's momentum and no
    step, the rest AdamW's state."""
    space = _space(optimizer="muon", **overrides)
    for name, param in space.params.items():
        if param.ndim == 2 and "embedding" not in name:
            space.state[name] = {"momentum_buffer": space.state[name]["exp_avg"]}
            del space.steps[name]
            space.groups[name] = {"lr": 1e-3, "momentum": 0.9, "wd_mult": 1.0, "lr_mult": 1.0}
    return space


def test_a_layer_wise_muon_checkpoint_converts_to_ours_and_back_bitwise(tmp_path: Path) -> None:
    """megatron-core's Muon (LayerWise) in torch_dist: each child's state under ``chained_<i>.``,
    its children int-keyed in the common state (as Megatron's load needs them), AdamW's step as
    ``common_step``; in fsdp_dtensor a matrix's ``momentum_buffer`` (swiglu halves too) and no
    step; and back, every tensor bitwise."""
    space = _muon_space()
    source = tmp_path / "torch_dist" / "iter_0000007"
    write_checkpoint(str(source), torch_dist_values(space))
    files = DcpFiles(str(source))
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    assert f"chained_0.optimizer.state.momentum_buffer.{qkv}" in files.tensor_keys
    assert "chained_1.optimizer.state.exp_avg.embedding.word_embeddings.weight" in files.tensor_keys
    optimizer = files.objects([COMMON_KEY])[COMMON_KEY][0]["optimizer"]
    assert sorted(optimizer) == [0, 1]
    assert float(optimizer[1]["optimizer"]["state"]["common_step"]) == 7.0
    convert("torch_dist", str(source), str(tmp_path / "fsdp"), progress=lambda _: None)
    ours = read_fsdp_dtensor(str(tmp_path / "fsdp" / "iter_0000007"))
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
    assert torch.equal(ours.state[fc1]["momentum_buffer"], space.state[fc1]["momentum_buffer"])
    assert fc1 not in ours.steps and ours.steps["decoder.final_layernorm.weight"] == 7.0
    values = DcpFiles(str(tmp_path / "fsdp" / "iter_0000007")).tensor_keys
    assert f"{names.FSDP_STATE_PREFIX}{fc1}_w.momentum_buffer" in values
    assert f"{names.FSDP_STATE_PREFIX}{fc1}_w.step" not in values
    summary = convert("fsdp_dtensor", str(tmp_path / "fsdp"), str(tmp_path / "back"))
    assert "Muon's momentum_buffer per matrix" in "\n".join(summary.lines())
    after = DcpFiles(str(tmp_path / "back" / "iter_0000007"))
    assert sorted(after.tensor_keys) == sorted(files.tensor_keys)
    got, expected = after.tensors(list(after.tensor_keys)), files.tensors(list(files.tensor_keys))
    assert not [key for key in expected if not torch.equal(got[key], expected[key])]
    assert sorted(after.objects([COMMON_KEY])[COMMON_KEY][0]["optimizer"]) == [0, 1]


def test_muon_with_a_learned_position_embedding_is_refused_naming_it(tmp_path: Path) -> None:
    """megatron-core's Muon orthogonalizes it, ours runs it on AdamW: no counterpart."""
    space = _muon_space()
    name = "embedding.position_embeddings.weight"
    space.params[name] = torch.zeros(16, HIDDEN)
    space.state[name] = {"momentum_buffer": torch.zeros(16, HIDDEN)}
    space.groups[name] = space.groups["decoder.layers.0.self_attention.linear_proj.weight"]
    write_checkpoint(str(tmp_path / "in" / "iter_0000007"), torch_dist_values(space))
    with pytest.raises(ConversionRefused, match="position-embedding-type rope"):
        convert("torch_dist", str(tmp_path / "in" / "iter_0000007"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_muon_without_layer_wise_is_refused_naming_it(tmp_path: Path) -> None:
    """``--optimizer muon`` without ``--use-distributed-optimizer``: not LayerWise's state."""
    values = torch_dist_values(_space())
    values[COMMON_KEY][0]["args"].optimizer = "muon"
    write_checkpoint(str(tmp_path / "in" / "iter_0000007"), values)
    with pytest.raises(ConversionRefused, match="LayerWiseDistributedOptimizer"):
        convert("torch_dist", str(tmp_path / "in" / "iter_0000007"), str(tmp_path / "out"))


def test_an_fsdp_dtensor_checkpoint_of_muon_state_is_refused_naming_the_state(
    tmp_path: Path,
) -> None:
    values = fsdp_dtensor_values(read_torch_dist(str(_saved_torch_dist(tmp_path, _space()))))
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    values[f"{names.FSDP_STATE_PREFIX}{name}.momentum_buffer"] = torch.zeros(HIDDEN, HIDDEN)
    write_checkpoint(str(tmp_path / "muon" / "iter_0000007"), values)
    with pytest.raises(ConversionRefused, match="momentum_buffer"):
        convert("fsdp_dtensor", str(tmp_path / "muon" / "iter_0000007"), str(tmp_path / "out"))


def test_the_command_line_prints_a_refusal_naming_it_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron_muon.convert.__main__ import main

    source = _saved_torch_dist(tmp_path, _space(), param_state_sharding_type="dp_reshardable")
    assert main(["--from", "torch_dist", str(source), str(tmp_path / "out")]) == 2
    printed = capsys.readouterr().err
    assert printed.startswith("refused: ") and "'dp_reshardable'" in printed
    assert not (tmp_path / "out").exists()


def test_a_pickle_that_would_run_code_is_refused_and_never_runs(tmp_path: Path) -> None:
    from megatron_muon.checkpointing import UnsafeCheckpointError
    from tests.crafted_pickles import Payload

    values = torch_dist_values(_space())
    marker = tmp_path / "ran"
    values[COMMON_KEY][0]["args"].note = Payload(str(marker))  # in Megatron's args
    write_checkpoint(str(tmp_path / "crafted" / "iter_0000007"), values)
    with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system"):
        convert("torch_dist", str(tmp_path / "crafted" / "iter_0000007"), str(tmp_path / "out"))
    assert not marker.exists() and not (tmp_path / "out").exists()
