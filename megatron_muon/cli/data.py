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
    """``seq_length``-token windows of a byte stream, as GPT samples.

    By default sample ``i`` covers bytes ``[i * seq_length, (i + 1) * seq_length + 1)``:
    ``tokens`` are the first ``seq_length``, ``labels`` the same shifted by one. With
    ``num_samples`` above the number of windows, samples wrap around (epochs), as Megatron's
    datasets do.

    ``shuffle_seed`` reads the windows in a fixed random order (the same on every rank for the
    same seed; each epoch the same), as Megatron's ``GPTDataset`` shuffles its samples: in stream
    order a global batch is a few kilobytes of one or two files, and the loss of each iteration
    follows those files (tables of constants, prose, code) more than the model.

    ``fixed_windows=N`` keeps only ``N`` windows, evenly spaced over the whole stream (every file
    of a held-out split is represented), and wraps around after them: a validation set whose
    evaluations each read exactly ``N`` consecutive samples then sees the same ``N`` windows, in
    the same order, every time. Megatron's evaluation draws ``eval_iters`` fresh batches from a
    continuing iterator; over consecutive windows of the stream each evaluation would read other
    files, and the validation curve would follow the files rather than the model.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_length: int,
        num_samples: int | None = None,
        fixed_windows: int | None = None,
        shuffle_seed: int | None = None,
    ):
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.tokens = tokens
        self.seq_length = seq_length
        num_stream_windows = (tokens.numel() - 1) // seq_length
        if num_stream_windows < 1:
            raise ValueError(f"{tokens.numel()} tokens are fewer than one sequence of {seq_length}")
        if fixed_windows is not None and fixed_windows < 1:
            raise ValueError(f"fixed_windows must be positive, got {fixed_windows}")
        self.num_windows = min(fixed_windows or num_stream_windows, num_stream_windows)
        # window k starts at stream window floor(k * num_stream_windows / num_windows)
        self.starts = [
            (k * num_stream_windows // self.num_windows) * seq_length
            for k in range(self.num_windows)
        ]
        self.order: list[int] | None = None
        if shuffle_seed is not None:
            generator = torch.Generator().manual_seed(shuffle_seed)
            self.order = torch.randperm(self.num_windows, generator=generator).tolist()
        self.num_samples = num_samples if num_samples is not None else self.num_windows
        self.position_ids = torch.arange(seq_length, dtype=torch.int64)
        self.loss_mask = torch.ones(seq_length, dtype=torch.float32)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = index % self.num_windows
        start = self.starts[self.order[window] if self.order is not None else window]
        sequence = self.tokens[start : start + self.seq_length + 1].to(torch.int64)
        return {
            "tokens": sequence[:-1],
            "labels": sequence[1:],
            "loss_mask": self.loss_mask,
            "position_ids": self.position_ids,
        }
