"""What a benchmark run must contain: every figure, as a dotted path into ``results.json``."""

from __future__ import annotations

from benchmarks.headline import RATIOS

__all__ = ["PEERS_FIGURES", "REQUIRED_FIGURES", "missing_figures"]

# Every figure the issue asks for, as dotted paths into results.json ("*" = every DP entry).
REQUIRED_FIGURES = (
    *(f"headline.ratios.{name}.median" for name in RATIOS),
    *(f"headline.ratios.{name}.values" for name in RATIOS),
    "headline.load_average_before",
    "headline.load_average_after",
    "optimizer_step.dense.by_dp.*.owner_s",
    "optimizer_step.dense.by_dp.*.gather_s",
    "optimizer_step.dense.by_dp.*.gather_over_owner",
    "optimizer_step.dense.by_dp.*.owner.ns_flops_max",
    "optimizer_step.dense.by_dp.*.owner.ns_flops_mean",
    "optimizer_step.dense.by_dp.*.owner.bytes_sent_max",
    "optimizer_step.dense.by_dp.*.owner.bytes_sent_mean",
    "optimizer_step.dense.by_dp.*.gather.ns_flops_max",
    "optimizer_step.dense.by_dp.*.gather.bytes_sent_max",
    "optimizer_step.dense.by_dp.*.ns_flops_per_s_per_rank",
    "optimizer_step.moe.by_dp.*.owner_s",
    "optimizer_step.moe.by_dp.*.gather_s",
    "optimizer_step.moe.by_dp.*.gather_over_owner",
    "optimizer_step.moe.by_dp.*.owner.ns_flops_max",
    "optimizer_step.moe.by_dp.*.owner.bytes_sent_max",
    "optimizer_step.moe.by_dp.*.owner.bytes_sent_mean",
    "training_step.muon_step_s",
    "training_step.adamw_step_s",
    "training_step.muon_over_adamw_step",
    "training_step.muon_optimizer_s",
    "training_step.adamw_optimizer_s",
    "training_step.muon_over_adamw_optimizer",
    "stock_comparison.ours_s",
    "stock_comparison.tensor_parallel_muon_s",
    "stock_comparison.emerging_muon_s",
    "stock_comparison.tensor_parallel_muon_over_ours",
    "stock_comparison.emerging_muon_over_ours",
    "memory.training_step.muon_peak_bytes",
    "memory.training_step.adamw_peak_bytes",
    "memory.training_step.muon_over_adamw",
    "memory.exchange_transient.measure",
    "memory.exchange_transient.by_model.*.*.owner_peak_step_bytes_max",
    "memory.exchange_transient.by_model.*.*.gather_peak_step_bytes_max",
    "memory.exchange_transient.by_model.*.*.owner_full_matrix_bytes_max",
    "memory.exchange_transient.by_model.*.*.gather_full_matrix_bytes_max",
    "memory.exchange_transient.by_model.*.*.gather_over_owner",
    "memory.exchange_transient.by_model.*.*.owner_bucketed_peak_step_bytes_max",
    "scaling.hidden",
    "scaling.seconds",
    "scaling.growth_exponent",
    "matmul_peak.flops_per_s",
    "ns_methods",
    "ns_batching",
)
# The figures of ``python -m benchmarks --peers`` (the peers, ideal-ratio and overlap sections).
PEERS_FIGURES = (
    "peers.rows",
    "peers.step_times.*.ours.seconds",
    "ideal_ratio.rows",
    "ideal_ratio.largest_tokens_measured_over_ideal",
    "overlap.by_dp.*.overlapped_over_sequential_s",
    "overlap.by_dp.*.overlapped_over_sequential_transient",
)


def missing_figures(results: dict, extra: tuple[str, ...] = ()) -> list[str]:
    """Each ``REQUIRED_FIGURES`` (and ``extra``) path absent from ``results``, with ``*`` replaced
    by the keys present (a ``*`` level with no keys at all is reported with the ``*`` in place)."""
    missing: list[str] = []

    def walk(node: object, parts: list[str], done: list[str]) -> None:
        if not parts:
            return
        head, rest = parts[0], parts[1:]
        if head == "*" and isinstance(node, dict) and node:
            for key, child in node.items():
                walk(child, rest, [*done, key])
        elif head != "*" and isinstance(node, dict) and node.get(head) is not None:
            walk(node[head], rest, [*done, head])
        else:
            missing.append(".".join(done + parts))

    for figure in (*REQUIRED_FIGURES, *extra):
        walk(results, figure.split("."), [])
    return missing
