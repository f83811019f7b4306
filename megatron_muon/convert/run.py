"""``convert``: one checkpoint read into model space and written in the other format.

``SRC``: a checkpoint root (Megatron's ``--save`` directory; its tracker names the iteration) or one
``iter_XXXXXXX`` directory. ``DST``: a root that gets ``iter_XXXXXXX`` and the tracker
``latest_checkpointed_iteration.txt``, as Megatron's ``--load`` reads them; it must not hold that
iteration already (nothing is overwritten). Everything is read and checked before anything is
written: a refusal leaves ``DST`` as it was.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_muon.convert import fsdp_dtensor, torch_dist
from megatron_muon.convert.dcp_files import write_checkpoint
from megatron_muon.convert.model_space import ModelSpace
from megatron_muon.convert.names import FormatT

__all__ = ["ConversionSummary", "convert", "iteration_directory"]

TRACKER = "latest_checkpointed_iteration.txt"
_READERS: dict[FormatT, Callable[[str], ModelSpace]] = {
    "torch_dist": torch_dist.read_torch_dist,
    "fsdp_dtensor": fsdp_dtensor.read_fsdp_dtensor,
}
_WRITERS: dict[FormatT, Callable[[ModelSpace], dict[str, Any]]] = {
    "torch_dist": torch_dist.torch_dist_values,
    "fsdp_dtensor": fsdp_dtensor.fsdp_dtensor_values,
}
# torch_dist's directory marker, as megatron-core writes it (dist_checkpointing's metadata.json).
_TORCH_DIST_MARKER = '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'


@dataclass
class ConversionSummary:
    """What one conversion did (the command's last lines)."""

    source: str
    target: str
    iteration: int
    tensors: int
    params: int
    optimizer_states: int
    wall_s: float
    carried: str = "Adam's exp_avg, exp_avg_sq, step per param"
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [
            f"converted {self.source} -> {self.target} (iteration {self.iteration}) "
            f"in {self.wall_s:.1f} s",
            f"  tensors written: {self.tensors} ({self.params} params)",
            f"  optimizer states carried: {self.optimizer_states} ({self.carried}; param "
            "groups; scheduler)",
            "  not carried: RNG states (one per saving rank; load with --no-load-rng)",
            *(f"  {note}" for note in self.notes),
        ]


def _carried(space: ModelSpace) -> str:
    """What of the optimizer state is carried, in words (the summary's line)."""
    if space.optimizer != "muon":
        return "Adam's exp_avg, exp_avg_sq, step per param"
    return "Muon's momentum_buffer per matrix; AdamW's exp_avg, exp_avg_sq, step per other param"


def iteration_directory(path: str) -> str:
    """``path`` itself if it holds DCP metadata, else the iteration its tracker names."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    tracker = os.path.join(path, TRACKER)
    if not os.path.isfile(tracker):
        raise FileNotFoundError(f"{path}: neither a checkpoint iteration nor a root with {TRACKER}")
    with open(tracker) as stream:
        text = stream.read().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker} holds {text!r}, not an iteration number")
    return os.path.join(path, f"iter_{int(text):07d}")


def convert(
    source_format: FormatT,
    source: str,
    target: str,
    progress: Callable[[str], None] = print,
) -> ConversionSummary:
    """Converts checkpoint ``source`` (``source_format``) into the other format under root
    ``target``. One process; every check before the first write.

    Raises:
        ConversionRefused: a layout or state that cannot map (named); nothing written.
        FileExistsError: ``target`` holds that iteration already.
    """
    start = time.monotonic()
    target_format: FormatT = "fsdp_dtensor" if source_format == "torch_dist" else "torch_dist"
    directory = iteration_directory(source)
    progress(f"reading {source_format} checkpoint {directory}")
    space = _READERS[source_format](directory)
    progress(f"read {len(space.params)} params at iteration {space.iteration}; checking")
    space.check()
    values = _WRITERS[target_format](space)
    out = os.path.join(target, f"iter_{space.iteration:07d}")
    progress(f"writing {target_format} checkpoint {out}")
    write_checkpoint(out, values)
    if target_format == "torch_dist":
        with open(os.path.join(out, "metadata.json"), "w") as stream:
            stream.write(_TORCH_DIST_MARKER)
    with open(os.path.join(target, TRACKER), "w") as stream:
        stream.write(str(space.iteration))
    tensors = sum(1 for value in values.values() if hasattr(value, "shape"))
    return ConversionSummary(
        source=f"{source_format} {directory}",
        target=f"{target_format} {out}",
        iteration=space.iteration,
        tensors=tensors,
        params=len(space.params),
        optimizer_states=sum(len(state) for state in space.state.values()) + len(space.steps),
        wall_s=time.monotonic() - start,
        carried=_carried(space),
        notes=space.notes,
    )
