"""The GPU run's targets, its DP = 8-64 prediction and its report (``benchmarks.gpu_run``).

Targets (issue: "On a real GPU"), each met or not with the figures behind it:

- ``ns_over_matmul``: NS (bf16, hidden >= 4096) at >= 60% of the measured bf16 matmul rate;
- ``ours_over_tensor_parallel_muon``: ``ShardedMuon`` / ``TensorParallelMuon`` step <= 1.02, DP=1;
- ``gram_over_standard``: Gram NS >= 1.4x faster than standard at aspect ratio >= 4;
- ``symmetric_over_standard``: symmetric NS no slower than standard (bf16, hidden >= 4096): where
  met, the symmetric method can become the default NS method (docs/newton_schulz.md);
- ``muon_over_adamw_step``: whole training step, Muon / AdamW <= 1.10 on the 1B+ GPT, DP=1;
- ``muon_over_adamw_peak_memory``: peak memory of a training step, Muon / AdamW <= 0.95.

The prediction prices the plan tool's per-rank figures (``megatron_muon.plan``: our owner plan's NS
FLOPs and bytes sent on the busiest rank at DP = 8-64, the same GPT) at the owner step's NS rate
measured here, plus the bytes at ``ASSUMED_LINK_BYTES_PER_S`` (one GPU measures no link), plus the
rest of the measured Muon optimizer step (its time beyond NS at DP = 1: AdamW on the embeddings,
grad norm, clipping, weight install) divided by DP, as that work is elementwise over shards; the
forward and backward time per rank stays what was measured (same tokens per rank), and AdamW's
step is divided by DP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.gpu_config import GpuBenchConfig

__all__ = ["TARGETS", "ASSUMED_LINK_BYTES_PER_S", "predict", "verdicts", "format_markdown"]

# name -> (what, (comparison, bound))
TARGETS = {
    "ns_over_matmul": ("NS (bf16) / bf16 matmul rate, hidden >= 4096 (worst shape)", (">=", 0.60)),
    "ours_over_tensor_parallel_muon": ("ShardedMuon / TensorParallelMuon step, DP=1", ("<=", 1.02)),
    "gram_over_standard": ("Gram / standard NS speed-up, aspect >= 4 (worst)", (">=", 1.4)),
    "symmetric_over_standard": (
        "symmetric / standard NS time, bf16, hidden >= 4096 (worst shape)",
        ("<=", 1.0),
    ),
    "muon_over_adamw_step": ("whole training step Muon / AdamW, 1B+ GPT, DP=1", ("<=", 1.10)),
    "muon_over_adamw_peak_memory": ("training-step peak memory Muon / AdamW", ("<=", 0.95)),
}
# NVLink 4 on H100 SXM: 450 GB/s per direction per GPU; an all-to-all reaches less. An assumption,
# not a measurement (one GPU here).
ASSUMED_LINK_BYTES_PER_S = 300e9
PREDICTED_DP = (8, 16, 32, 64)


def _ok(section: object) -> bool:
    return isinstance(section, (dict, list)) and not (
        isinstance(section, dict) and "error" in section
    )


def _values(results: dict) -> dict[str, float | None]:
    """Each target's measured value (None where its section failed)."""
    values: dict[str, float | None] = dict.fromkeys(TARGETS)
    matmul = results.get("matmul")
    if _ok(matmul) and _ok(results.get("newton_schulz")):
        rate = matmul["flops_per_s"]
        wide = [r for r in results["newton_schulz"] if min(r["shape"]) >= 4096] or list(
            results["newton_schulz"]
        )
        values["ns_over_matmul"] = min(r["flops_per_s"] for r in wide) / rate
    stock = results.get("stock")
    if _ok(stock):
        seconds = stock["stock_s"]
        values["ours_over_tensor_parallel_muon"] = seconds["ours"] / seconds["tensor_parallel_muon"]
    gram = results.get("gram")
    if _ok(gram):
        wide = [
            g for g in gram if g["shape"][-1] >= 4 * g["shape"][-2] and g["precision"] == "fp16"
        ]
        if wide:
            values["gram_over_standard"] = min(g["speedup"] for g in wide)
    symmetric = results.get("symmetric")
    if _ok(symmetric):
        bf16 = [r for r in symmetric if r["precision"] == "medium"]
        wide = [r for r in bf16 if min(r["shape"]) >= 4096] or bf16
        values["symmetric_over_standard"] = max(r["symmetric_over_standard"] for r in wide)
    training = results.get("training")
    if _ok(training):
        muon, adamw = training["muon"], training["adamw"]
        values["muon_over_adamw_step"] = muon["step_s"] / adamw["step_s"]
        if "peak_bytes" in muon:
            values["muon_over_adamw_peak_memory"] = muon["peak_bytes"] / adamw["peak_bytes"]
    return values


def verdicts(results: dict) -> dict[str, dict]:
    """``{target: {what, bound, value, met}}``; ``met`` is None where the value is missing."""
    out = {}
    for name, value in _values(results).items():
        what, (op, bound) = TARGETS[name]
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        out[name] = {"what": what, "bound": f"{op} {bound}", "value": value, "met": met}
    return out


def predict(results: dict, config: GpuBenchConfig) -> dict:
    """Owner step and whole-step Muon/AdamW at DP = 8-64: the plan tool at the measured rates."""
    from megatron_muon.plan.model_specs import ModelSpec
    from megatron_muon.plan.models import default_parallelism
    from megatron_muon.plan.report import analyze

    stock, training = results.get("stock"), results.get("training")
    if not (_ok(stock) and _ok(training)):
        return {"error": "needs the stock and training sections"}
    owner = stock["owner"]
    ns_rate = owner["stats"]["ns_flops"] / owner["seconds"]
    gpt = config.gpt
    spec = ModelSpec(
        name="gpu-bench-gpt",
        num_layers=gpt.num_layers,
        hidden_size=gpt.hidden,
        num_attention_heads=gpt.num_heads,
        ffn_hidden_size=gpt.ffn_hidden,
        gated_linear_unit=False,
    )
    muon, adamw = training["muon"], training["adamw"]
    forward_backward = adamw["forward_backward_s"]
    beyond_ns = max(0.0, muon["optimizer_s"] - muon["ns_flops"] / ns_rate)
    rows = []
    for dp in (1, *PREDICTED_DP):
        ours = analyze(spec, default_parallelism(spec, dp), ns_bytes=2).figures("ours")
        optimizer_s = (
            ours.ns_flops_max / ns_rate
            + ours.bytes_sent_max / ASSUMED_LINK_BYTES_PER_S
            + beyond_ns / dp
        )
        adamw_s = adamw["optimizer_s"] / dp
        rows.append(
            {
                "dp": dp,
                "ns_flops_max": ours.ns_flops_max,
                "bytes_sent_max": ours.bytes_sent_max,
                "muon_optimizer_s": optimizer_s,
                "muon_over_adamw_step": (forward_backward + optimizer_s)
                / (forward_backward + adamw_s),
            }
        )
    return {
        "ns_rate_in_owner_step": ns_rate,
        "muon_optimizer_s_beyond_ns": beyond_ns,
        "assumed_link_bytes_per_s": ASSUMED_LINK_BYTES_PER_S,
        "forward_backward_s": forward_backward,
        "measured_muon_over_adamw_step": muon["step_s"] / adamw["step_s"],
        "rows": rows,
    }


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def format_markdown(results: dict) -> str:
    """The GPU section of docs/benchmarks.md: meta line, targets, sections, prediction."""
    meta = results.get("meta", {})
    lines = [
        f"Device: {meta.get('device_name')}; date {meta.get('date')}; commit "
        f"{meta.get('git_commit')}; torch {meta.get('torch')} (CUDA {meta.get('cuda')}); "
        f"run {_fmt(meta.get('seconds'), 4)} s.",
        "",
        "| target | bound | measured | met |",
        "|---|---|---|---|",
    ]
    for verdict in results["targets"].values():
        met = {True: "yes", False: "no", None: "not measured"}[verdict["met"]]
        lines.append(
            f"| {verdict['what']} | {verdict['bound']} | {_fmt(verdict['value'])} | {met} |"
        )
    if _ok(results.get("matmul")):
        lines += ["", f"bf16 matmul: {results['matmul']['flops_per_s'] / 1e12:.0f} TFLOP/s "
                  f"({results['matmul']['size']}^3)."]  # fmt: skip
    if _ok(results.get("newton_schulz")):
        lines += ["", "| NS shape (bf16) | ms | TFLOP/s |", "|---|---|---|"]
        for r in results["newton_schulz"]:
            lines.append(
                f"| {tuple(r['shape'])} | {r['seconds'] * 1e3:.2f} | "
                f"{r['flops_per_s'] / 1e12:.0f} |"
            )
    if _ok(results.get("stock")):
        s = results["stock"]["stock_s"]
        owner = results["stock"]["owner"]
        lines += [
            "",
            f"Optimizer step, DP=1: ShardedMuon {s['ours'] * 1e3:.1f} ms, TensorParallelMuon "
            f"{s['tensor_parallel_muon'] * 1e3:.1f} ms, emerging-optimizers Muon "
            f"{s['emerging_muon'] * 1e3:.1f} ms; owner step on row shards "
            f"{owner['seconds'] * 1e3:.1f} ms at "
            f"{owner['stats']['ns_flops'] / owner['seconds'] / 1e12:.0f} NS TFLOP/s.",
        ]
    if _ok(results.get("gram")):
        lines += ["", "| Gram vs standard | precision | standard ms | gram ms | speed-up |"]
        lines.append("|---|---|---|---|---|")
        for g in results["gram"]:
            lines.append(
                f"| {tuple(g['shape'])} | {g['precision']} | {g['standard_s'] * 1e3:.2f} | "
                f"{g['gram_s'] * 1e3:.2f} | {g['speedup']:.2f}x |"
            )
    if _ok(results.get("symmetric")):
        lines += ["", "| symmetric vs standard NS | precision | standard ms | symmetric ms | "
                  "time ratio | FLOP ratio |", "|---|---|---|---|---|---|"]  # fmt: skip
        for r in results["symmetric"]:
            lines.append(
                f"| {tuple(r['shape'])} | {r['precision']} | {r['standard_s'] * 1e3:.2f} | "
                f"{r['symmetric_s'] * 1e3:.2f} | {r['symmetric_over_standard']:.3f} | "
                f"{r['flop_ratio']:.3f} |"
            )
    syrk = results.get("syrk")
    if _ok(syrk) and syrk["problem"] is not None:
        lines += ["", f"syrk NS (`--muon-use-syrk`) not run: {syrk['problem']}."]
    elif _ok(syrk):
        lines += ["", "| syrk vs standard NS (bf16) | standard ms | syrk ms | time ratio | "
                  "first call s |", "|---|---|---|---|---|"]  # fmt: skip
        for r in syrk["rows"]:
            if "error" in r:
                lines.append(f"| {tuple(r['shape'])} | | | not run: {r['error']} | |")
                continue
            lines.append(
                f"| {tuple(r['shape'])} | {r['standard_s'] * 1e3:.2f} | {r['syrk_s'] * 1e3:.2f} | "
                f"{r['syrk_over_standard']:.3f} | {r['first_call_s']:.1f} |"
            )
    if _ok(results.get("training")):
        lines += ["", "| training step | step ms | optimizer ms | peak GiB | state GiB |"]
        lines.append("|---|---|---|---|---|")
        for kind in ("muon", "adamw"):
            t = results["training"][kind]
            lines.append(
                f"| {kind} | {t['step_s'] * 1e3:.1f} | {t['optimizer_s'] * 1e3:.1f} | "
                f"{_fmt(t.get('peak_bytes', 0) / 2**30)} | "
                f"{_fmt(t.get('state_bytes', 0) / 2**30)} |"
            )
    prediction = results.get("prediction", {})
    if "rows" in prediction:
        lines += [
            "",
            "| DP | NS GFLOP/rank (max) | MiB sent/rank | Muon step ms | Muon/AdamW step |",
        ]
        lines.append("|---|---|---|---|---|")
        for r in prediction["rows"]:
            lines.append(
                f"| {r['dp']} | {r['ns_flops_max'] / 1e9:.0f} | "
                f"{r['bytes_sent_max'] / 2**20:.0f} | "
                f"{r['muon_optimizer_s'] * 1e3:.1f} | {r['muon_over_adamw_step']:.3f} |"
            )
    for name, value in results.items():
        if isinstance(value, dict) and "error" in value:
            lines += ["", f"Section {name} failed: {value['error']}"]
    return "\n".join(lines)
