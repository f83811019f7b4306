"""Models the plan tool knows: ``ModelSpec`` (a transformer's sizes under Megatron's argument
names: ``--num-layers`` is ``num_layers``, ...), the ``PRESETS`` by name, and
``load_model_config`` for a YAML file of one's own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

__all__ = ["PRESETS", "ModelSpec", "load_model_config"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A GPT-style model's sizes, named after Megatron's arguments (``--hidden-size`` ...)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    gated_linear_unit: bool = True
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | tuple[int, ...] = 1
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    default_ep: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.query_groups:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_query_groups {self.query_groups}"
            )
        if isinstance(self.moe_layer_freq, tuple) and len(self.moe_layer_freq) != self.num_layers:
            raise ValueError(
                f"moe_layer_freq lists {len(self.moe_layer_freq)} layers, model has "
                f"{self.num_layers}"
            )
        if self.num_experts and not self.moe_ffn_hidden_size:
            raise ValueError("a MoE model (num_experts) needs moe_ffn_hidden_size")

    @property
    def query_groups(self) -> int:
        """``num_query_groups``, defaulting to one per head (multi-head attention)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """``kv_channels``, defaulting to ``hidden_size / num_attention_heads``."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has an MoE MLP (Megatron's ``--moe-layer-freq``)."""
        if not self.num_experts:
            return False
        if isinstance(self.moe_layer_freq, tuple):
            return bool(self.moe_layer_freq[layer])
        return layer % self.moe_layer_freq == 0


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="gpt-125m",
            num_layers=12,
            hidden_size=768,
            num_attention_heads=12,
            ffn_hidden_size=3072,
            gated_linear_unit=False,
        ),
        ModelSpec(
            name="llama3-8b",
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            kv_channels=128,
            ffn_hidden_size=14336,
        ),
        ModelSpec(
            name="llama3-70b",
            num_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_query_groups=8,
            kv_channels=128,
            ffn_hidden_size=28672,
        ),
        ModelSpec(
            name="qwen3-30b-a3b",
            num_layers=48,
            hidden_size=2048,
            num_attention_heads=32,
            num_query_groups=4,
            kv_channels=128,
            ffn_hidden_size=6144,
            num_experts=128,
            moe_ffn_hidden_size=768,
            default_ep=8,
        ),
        ModelSpec(
            name="deepseek-v3",
            num_layers=61,
            hidden_size=7168,
            num_attention_heads=128,
            ffn_hidden_size=18432,
            num_experts=256,
            moe_ffn_hidden_size=2048,
            moe_shared_expert_intermediate_size=2048,
            moe_layer_freq=(0,) * 3 + (1,) * 58,
            multi_latent_attention=True,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_head_dim=128,
            qk_pos_emb_head_dim=64,
            v_head_dim=128,
            default_ep=64,
        ),
        # DeepSeek-V3's shape on CPU ranks (configs/tiny-deepseek-v3.yaml: the entry point's run).
        ModelSpec(
            name="tiny-deepseek-v3",
            num_layers=3,
            hidden_size=64,
            num_attention_heads=4,
            ffn_hidden_size=192,
            num_experts=4,
            moe_ffn_hidden_size=48,
            moe_shared_expert_intermediate_size=48,
            moe_layer_freq=(0, 1, 1),
            multi_latent_attention=True,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_head_dim=16,
            qk_pos_emb_head_dim=8,
            v_head_dim=16,
            default_ep=2,
        ),
    )
}


def load_model_config(path: str | Path) -> ModelSpec:
    """A ``ModelSpec`` from a YAML file: its ``model:`` mapping (or the top level, if none).

    Keys are ``ModelSpec`` fields (Megatron argument names with underscores); ``name`` defaults to
    the file's stem. Unknown keys are an error.
    """
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping, got {type(data).__name__}")
    model = data.get("model", data)
    if not isinstance(model, dict):
        raise ValueError(f"{path}: 'model' must be a mapping")
    known = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(model) - known)
    if unknown:
        raise ValueError(f"{path}: unknown model keys {unknown}; known: {sorted(known)}")
    values = dict(model)
    values.setdefault("name", Path(path).stem)
    if isinstance(values.get("moe_layer_freq"), list):
        values["moe_layer_freq"] = tuple(values["moe_layer_freq"])
    return ModelSpec(**values)
