"""Real text that ships with every Python install, as byte-level GPT training data.

The demo and the pretrain entry point train on the Python standard library's own ``.py`` sources:
real, varied text present on every machine, needing no download. Tokens are bytes (vocabulary 256).
Files are read in a fixed (sorted) order; whole files go to either the training or the held-out
validation split, so no text is shared between them. A user's own text file works the same way.

Samples have the keys and dtypes megatron-core's ``GPTDataset`` yields (``tokens``, ``labels``,
``loss_mask``, ``position_ids``), so Megatron's data loaders and ``forward_step`` functions take
them unchanged.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ByteTextDataset", "TextSplits", "load_text_splits", "stdlib_source_files"]

VOCAB_SIZE = 256


def stdlib_source_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted by path, without site-packages and tests."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts[:-1])
        if parts & {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}:
            continue
        files.append(path)
    if not files:
        raise FileNotFoundError(f"no .py sources found under the standard library at {root}")
    return files


@dataclass(frozen=True, slots=True)
class TextSplits:
    """Byte tokens (uint8, 1-D) of the training and validation text, and where they came from."""

    train: torch.Tensor
    valid: torch.Tensor
    source: str


def load_text_splits(
    path: str | Path | None = None,
    max_bytes: int = 8 * 2**20,
    valid_fraction: float = 0.05,
) -> TextSplits:
    """Loads byte tokens from ``path`` (a text file) or, by default, the standard library sources.

    Args:
        path: a text file of the user's; ``None`` for the standard library's ``.py`` files.
        max_bytes: at most this many bytes are read (the first files in sorted order).
        valid_fraction: share held out for validation: the last whole files (standard library),
            or the last bytes of a single file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a fraction outside (0, 1), or too little text for both splits.
    """
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--data-path {path} is not a file")
        data = path.read_bytes()[:max_bytes]
        cut = int(len(data) * (1.0 - valid_fraction))
        train, valid, source = data[:cut], data[cut:], str(path)
    else:
        chunks: list[bytes] = []
        total = 0
        for file in stdlib_source_files():
            content = file.read_bytes()
            chunks.append(content)
            total += len(content)
            if total >= max_bytes:
                break
        num_valid = max(1, int(len(chunks) * valid_fraction))
        train = b"".join(chunks[:-num_valid])
        valid = b"".join(chunks[-num_valid:])
        source = f"Python {sysconfig.get_python_version()} standard library ({len(chunks)} files)"
    if len(train) < 2 or len(valid) < 2:
        raise ValueError(f"too little text in {source} for a training and a validation split")
    return TextSplits(
        train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        valid=torch.frombuffer(bytearray(valid), dtype=torch.uint8),
        source=source,
    )


class ByteTextDataset(torch.utils.data.Dataset):
    """Consecutive ``seq_length``-token windows of a byte stream, as GPT samples.

    Sample ``i`` covers bytes ``[i * seq_length, (i + 1) * seq_length + 1)``: ``tokens`` are the
    first ``seq_length``, ``labels`` the same shifted by one. With ``num_samples`` above the number
    of windows, samples wrap around (epochs), as Megatron's datasets do.
    """

    def __init__(self, tokens: torch.Tensor, seq_length: int, num_samples: int | None = None):
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.tokens = tokens
        self.seq_length = seq_length
        self.num_windows = (tokens.numel() - 1) // seq_length
        if self.num_windows < 1:
            raise ValueError(f"{tokens.numel()} tokens are fewer than one sequence of {seq_length}")
        self.num_samples = num_samples if num_samples is not None else self.num_windows
        self.position_ids = torch.arange(seq_length, dtype=torch.int64)
        self.loss_mask = torch.ones(seq_length, dtype=torch.float32)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = (index % self.num_windows) * self.seq_length
        window = self.tokens[start : start + self.seq_length + 1].to(torch.int64)
        return {
            "tokens": window[:-1],
            "labels": window[1:],
            "loss_mask": self.loss_mask,
            "position_ids": self.position_ids,
        }
