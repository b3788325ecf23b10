"""Model FLOPs and model FLOPs utilization (MFU), as PaLM defines them.

Chowdhery et al. 2022 ("PaLM"), appendix B: a dense decoder trained on sequences of T tokens
costs, per token, 6N FLOPs for its matmuls (forward 2N, backward 4N) plus 12 L H Q T for
attention (forward: QK^T and the weighted sum of V, 2 T H Q each per layer; times 3 with the
backward pass), where N is the parameter count without the embedding lookup, L the layers and
H Q = hidden. The count is of the model, not of the hardware's work: recomputation under
activation checkpointing does not raise it, which is why MFU is comparable across setups
(HFU would count it).
"""

from __future__ import annotations

# Dense (not 2:4 sparse) peak FLOP/s per SXM GPU by the vendor's data sheets, per compute
# dtype. H100 and H200 SXM share the compute die; H200 differs in memory only. PCIe and NVL
# variants run lower and are not listed.
PEAK_FLOPS = {
    "H200": {"bf16": 989.4e12, "fp32": 66.9e12},
    "H100": {"bf16": 989.4e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
}


def matmul_params(*, n_layer: int, n_embd: int, vocab: int) -> int:
    """N for the reference GPT (`trainer/model.py`): per layer the QKV, output, and two MLP
    projections (12 C^2 weights, 9 C biases) and two LayerNorms (4 C); the final LayerNorm
    (2 C); the output head (V C, tied to the token embedding, so counted once here and not
    again as a lookup). Position embeddings are a lookup and are left out."""
    per_layer = 12 * n_embd * n_embd + 9 * n_embd + 4 * n_embd
    return n_layer * per_layer + 2 * n_embd + vocab * n_embd


def training_flops_per_token(*, params: int, n_layer: int, n_embd: int, seq: int) -> float:
    """6N + 12 L C T: forward and backward of one token in a T-token sequence."""
    return 6.0 * params + 12.0 * n_layer * n_embd * seq


def peak_flops(device_name: str, dtype: str) -> float | None:
    """The data-sheet peak for a device name as torch reports it ("NVIDIA H200", ...), or
    None where it is not known (CPUs, other GPUs): MFU is then not reported."""
    name = device_name.upper()
    if "PCIE" in name or "NVL" in name:
        return None  # lower clocks and power than the SXM parts the table holds
    for model, peaks in PEAK_FLOPS.items():
        if model in name:
            return peaks.get(dtype)
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak: float) -> float:
    """Achieved model FLOP/s over the peak."""
    return tokens_per_s * flops_per_token / peak
