"""What one Muon step's Newton-Schulz work costs: FLOPs and bytes per matrix and per rank.

Pure functions of shapes and the NS config, with no process group and no tensor: the owner planner
(``planner``, ``step_plan``), ``ShardedMuon``'s FLOP counts and the plan tool
(``python -m megatron_muon.plan``) take their costs from here.

- ``pieces_flops``: NS FLOPs of a matrix made of NS pieces (Q, K and V apart under QKV split, else
  the matrix itself), through the NS-method registry (``NSConfig.flops``).
- Split NS (``split_newton_schulz``): a matrix's NS over ``g`` ranks, each holding a block of its
  long dimension (``long_dim``, ``split_bounds``, ``split_dim_of_pieces``); the FLOPs each rank
  performs (``split_ns_flops``, ``split_pieces_flops``) and the bytes each sends
  (``split_ns_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_muon.newton_schulz.methods import NSConfig

__all__ = [
    "long_dim",
    "pieces_flops",
    "split_bounds",
    "split_dim_of_pieces",
    "split_ns_bytes",
    "split_ns_flops",
    "split_pieces_flops",
]


def pieces_flops(pieces: Sequence[tuple[int, int]], config: NSConfig) -> int:
    """NS FLOPs of a matrix made of ``pieces`` (``(rows, cols)`` each) under ``config``."""
    return sum(config.flops(rows, cols) for rows, cols in pieces)


def long_dim(rows: int, cols: int) -> int:
    """The dim a split NS divides: 0 for a tall matrix, 1 for a wide or square one.

    It is the dim ``newton_schulz`` keeps long (it transposes exactly when ``rows > cols``), so the
    split form performs the same products as the full one, only summed in pieces.
    """
    return 0 if rows > cols else 1


def split_bounds(length: int, num_parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each part of ``range(length)`` cut into ``num_parts`` near-even blocks.

    The first ``length % num_parts`` parts are one longer (``torch.tensor_split``'s rule); parts
    may be empty when ``num_parts > length``.
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be at least 1, got {num_parts}")
    if length < 0:
        raise ValueError(f"length must be non-negative, got {length}")
    base, extra = divmod(length, num_parts)
    bounds = []
    start = 0
    for part in range(num_parts):
        stop = start + base + (1 if part < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def split_ns_flops(rows: int, cols: int, num_ns_steps: int, num_parts: int, part: int) -> int:
    """FLOPs rank ``part`` of a ``num_parts``-rank group performs in ``split_newton_schulz``.

    With one part this equals the standard method's ``ns_flops(rows, cols, num_ns_steps)``.
    """
    if not 0 <= part < num_parts:
        raise ValueError(f"part must be in [0, {num_parts}), got {part}")
    k, long = min(rows, cols), max(rows, cols)
    l_start, l_stop = split_bounds(long, num_parts)[part]
    k_start, k_stop = split_bounds(k, num_parts)[part]
    return num_ns_steps * (4 * k * k * (l_stop - l_start) + 2 * (k_stop - k_start) * k * k)


def split_dim_of_pieces(pieces: Sequence[tuple[int, int]]) -> int | None:
    """The dim along which a param made of NS ``pieces`` can be split, or ``None`` if it cannot.

    A plain matrix is one piece and splits along its ``long_dim``. A QKV-split param's pieces
    (Q, K, V: row groups of one ``(rows, cols)`` param) share their columns, so the param splits by
    columns when every piece is wide or square: each rank then holds columns
    ``split_bounds(cols, g)[rank]`` of the whole param and runs ``split_newton_schulz`` on each
    piece's rows of that block. Pieces with different long dims cannot share one block layout.
    """
    if not pieces:
        return None
    if len(pieces) == 1:
        return long_dim(*pieces[0])
    if all(long_dim(rows, cols) == 1 for rows, cols in pieces):
        return 1
    return None


def split_pieces_flops(
    pieces: Sequence[tuple[int, int]], num_ns_steps: int, num_parts: int, part: int
) -> int:
    """``split_ns_flops`` summed over a param's NS pieces (Q, K, V, or the one matrix)."""
    return sum(split_ns_flops(r, c, num_ns_steps, num_parts, part) for r, c in pieces)


def split_ns_bytes(
    pieces: Sequence[tuple[int, int]], num_ns_steps: int, num_parts: int, element_bytes: int
) -> int:
    """Bytes one rank of a ``num_parts`` block sends (and receives) in ``split_newton_schulz``.

    Per piece and step, ring algorithms: the all-reduce of the ``(k, k)`` Gram matrix
    (``2 k^2 (g - 1) / g`` elements) and the all-gather of ``B``'s padded row blocks
    (``(g - 1) ceil(k / g) k``); the norm all-reduce is one element. ``element_bytes``: 2 under
    "medium" precision (bf16 iteration), 4 otherwise.
    """
    if num_parts == 1:
        return 0
    total = 0
    for rows, cols in pieces:
        k = min(rows, cols)
        gram = 2 * k * k * (num_parts - 1) // num_parts
        gather = (num_parts - 1) * -(-k // num_parts) * k
        total += num_ns_steps * (gram + gather) * element_bytes
    return total
