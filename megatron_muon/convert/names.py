"""Tensor names of the two formats, and the one model-space name a conversion goes through.

Measured on megatron-core 0.19.2 (Megatron-LM's loop, the tests' tiny GPT, ``--transformer-impl
local``; docs/checkpoints.md shows the keys):

- ``torch_dist`` (Megatron's DDP, ``--dist-ckpt-optim-fully-reshardable``): a layer's tensors are
  stacked over the layers, ``decoder.layers.<name>`` of shape ``(num_layers, *shape)``, each a
  global tensor (TP shards joined: the fused QKV rows as the TP = 1 layer holds them). The local
  spec saves its norms under Transformer Engine's names (``input_layernorm.`` ->
  ``self_attention.linear_qkv.layer_norm_``, ``pre_mlp_layernorm.`` -> ``mlp.linear_fc1.layer_
  norm_``: its ``sharded_state_dict_keys_map``). With ``--swiglu`` ``linear_fc1``'s global rows
  are the gate half of every TP rank, then the up half (``apply_swiglu_sharded_factory``).
  Optimizer state: ``optimizer.state.<kind>.<model key>`` (``param``: the fp32 main weights,
  ``exp_avg``, ``exp_avg_sq``); Adam's ``step`` per param group, in the common state.
- ``fsdp_dtensor`` (Megatron-FSDP): one global tensor per param, ``model.module.<param name>``;
  state ``optimizer.state.module.module.<param name>.<kind>`` (``step`` a 0-d tensor per param);
  ``optimizer.param_to_group_meta.module.module.<param name>.<field>``; with ``--swiglu``
  ``linear_fc1.{weight,bias}`` split into ``..._w`` (gate) and ``..._v`` (up) halves
  (``handle_swiglu_in_state_dict``), state halves alike.

The model-space name here is the param name of the Megatron-FSDP model (``decoder.layers.3.
input_layernorm.weight``; swiglu's ``linear_fc1`` whole).
"""

from __future__ import annotations

import re
from typing import Literal

__all__ = [
    "FSDP_MODEL_PREFIX",
    "FSDP_META_PREFIX",
    "FSDP_STATE_PREFIX",
    "FormatT",
    "fsdp_names",
    "is_stacked",
    "is_swiglu_fc1",
    "layer_of",
    "no_weight_decay",
    "stacked_name",
    "unstacked_name",
]

FormatT = Literal["torch_dist", "fsdp_dtensor"]

FSDP_MODEL_PREFIX = "model.module."
FSDP_STATE_PREFIX = "optimizer.state.module.module."
FSDP_META_PREFIX = "optimizer.param_to_group_meta.module.module."

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_STACKED = re.compile(r"^decoder\.layers\.(.+)$")
# The local spec's norms under Transformer Engine's names in torch_dist (its keys map).
_LOCAL_NORM_NAMES = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
_SWIGLU_FC1 = re.compile(r"(^|\.)mlp\.linear_fc1\.(weight|bias)$")


def layer_of(name: str) -> tuple[int, str] | None:
    """``decoder.layers.3.mlp.linear_fc1.weight`` -> ``(3, "mlp.linear_fc1.weight")``; a param
    outside the decoder's layers -> None."""
    match = _LAYER.match(name)
    return None if match is None else (int(match.group(1)), match.group(2))


def stacked_name(name: str, transformer_impl: str) -> tuple[str, int | None]:
    """A model-space param name -> (its torch_dist key, its layer index or None).

    ``transformer_impl`` (Megatron's ``--transformer-impl``): ``local`` renames the layer norms
    (module docstring); ``transformer_engine`` names them as torch_dist does already.
    """
    found = layer_of(name)
    if found is None:
        return name, None
    layer, rest = found
    if transformer_impl == "local":
        for local, saved in _LOCAL_NORM_NAMES.items():
            if rest.startswith(local):
                rest = saved + rest[len(local) :]
                break
    return f"decoder.layers.{rest}", layer


def unstacked_name(key: str, layer: int | None, transformer_impl: str) -> str:
    """A torch_dist key (and, for a stacked one, the layer index) -> the model-space name."""
    if layer is None:
        return key
    match = _STACKED.match(key)
    if match is None:
        raise ValueError(f"{key} is not a stacked decoder-layer key")
    rest = match.group(1)
    if transformer_impl == "local":
        for local, saved in _LOCAL_NORM_NAMES.items():
            if rest.startswith(saved):
                rest = local + rest[len(saved) :]
                break
    return f"decoder.layers.{layer}.{rest}"


def is_stacked(key: str) -> bool:
    """A torch_dist key of the decoder's layers (stacked over the layers)."""
    return _STACKED.match(key) is not None


def is_swiglu_fc1(name: str) -> bool:
    """``linear_fc1``'s weight or bias of a dense MLP (split in two by fsdp_dtensor's swiglu)."""
    return _SWIGLU_FC1.search(name) is not None


def fsdp_names(name: str, swiglu: bool) -> list[str]:
    """The fsdp_dtensor param names of one model-space param: itself, or swiglu's two halves
    (``<name>_w``: the gate rows, ``<name>_v``: the up rows)."""
    if swiglu and is_swiglu_fc1(name):
        return [f"{name}_w", f"{name}_v"]
    return [name]


def no_weight_decay(name: str, ndim: int) -> bool:
    """megatron-core's default weight-decay rule (``get_standard_config_overrides``): a bias or a
    1-D param goes to the ``wd_mult`` 0 group. ``ndim``: the param's own (not stacked) rank."""
    return name.endswith(".bias") or ndim == 1
