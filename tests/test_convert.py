"""``python -m megatron_muon.convert`` on hand-built checkpoints, one process: the key mapping of
both formats (the names measured from Megatron-LM's own saves, docs/checkpoints.md), a round trip
torch_dist -> fsdp_dtensor -> torch_dist bitwise, and each refusal named.

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
        ({"optimizer": "muon"}, {}, "--optimizer muon"),
        ({"pipeline_model_parallel_size": 2}, {}, "--pipeline-model-parallel-size 2"),
        ({"num_experts": 4}, {}, "--num-experts 4"),
        ({"bf16": True}, {}, "--bf16"),
        ({}, {"param_state_sharding_type": "dp_reshardable"}, "'dp_reshardable'"),
        ({}, {"param_state_sharding_type": None}, "--use-distributed-optimizer"),
    ],
    ids=["muon", "pipeline", "experts", "bf16", "dp_reshardable", "no_distributed_optimizer"],
)
def test_a_layout_that_cannot_map_is_refused_by_name_and_nothing_is_written(
    tmp_path: Path, overrides: dict[str, object], common: dict[str, object], named: str
) -> None:
    source = _saved_torch_dist(tmp_path, _space(**overrides), **common)
    with pytest.raises(ConversionRefused, match=named.replace("-", r"\-")):
        convert("torch_dist", str(source), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


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
