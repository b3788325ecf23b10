"""The memory planner's answer as text, for `lockstep plan` (trainer/planner.py computes it)."""

from __future__ import annotations

from trainer.planner import GiB, Plan, global_batch


def format_table(result: Plan, show_all: bool = False, top: int = 12) -> str:
    """The plan as text: the recommendation with its reasons, then the layouts."""
    m, c = result.model, result.cluster
    lines = [
        f"model: {m.total_params / 1e9:,.2f}B params"
        f"{' (derived)' if m.params is None else ''}, {m.layers} layers, hidden {m.hidden}, "
        f"{m.heads} heads, vocab {m.vocab:,}, seq {m.seq}, micro-batch {m.micro_batch}, "
        f"global batch {global_batch(m, c):,}, {m.dtype}, {m.optimizer}, "
        f"activation checkpointing {'on' if m.activation_checkpointing else 'off'}",
        f"cluster: {c.gpus:,} GPUs, {c.gpus_per_node} per node, {c.gpu_mem_gb:g} GiB each",
        "",
    ]
    if result.recommended:
        lines.append(f"recommended: {result.recommended.describe()}")
    else:
        lines.append("recommended: none")
    lines += [f"  - {reason}" for reason in result.reasons]
    lines.append("")
    header = (
        f"{'dp':>5} {'tp':>3} {'pp':>3} {'zero':>4} | {'weights':>8} {'grads':>8} "
        f"{'optim':>8} {'activ':>8} {'total':>8} | {'comm/step':>9} | fits"
    )
    lines += [header + "   (GiB per GPU)", "-" * len(header)]
    shown = result.layouts if show_all else result.layouts[:top]
    for lay in shown:
        b = lay.per_gpu_bytes
        mark = "yes" if lay.fits else "no"
        if lay is result.recommended:
            mark += "  <- recommended"
        lines.append(
            f"{lay.dp:>5} {lay.tp:>3} {lay.pp:>3} {lay.zero:>4} | "
            + " ".join(
                f"{b[k] / GiB:>8.1f}"
                for k in ("weights", "grads", "optimizer", "activations", "total")
            )
            + f" | {lay.comm_bytes_per_step / GiB:>9.1f} | {mark}"
        )
    hidden_count = len(result.layouts) - len(shown)
    if hidden_count:
        lines.append(f"... {hidden_count} more layouts (--all to list them)")
    return "\n".join(lines)
