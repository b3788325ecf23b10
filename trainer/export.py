"""Export a registered checkpoint: `python -m trainer.export SRC DST [--format FORMAT]`. The
portal's queue worker runs it as a command, so torch stays out of the platform's own processes
(the domain imports no torch).

- `dcp` (the reference trainer's sharded save): consolidated into one `torch.save` file.
- `lightning`, `hf`, `torch` (a framework's own save, nodeagent/saves.py): the model's weights
  as one `safetensors` file. A save is never unpickled unrestricted: a researcher's pickle
  would run code in the portal's worker. `torch.load(weights_only=True)` reads tensors and
  plain data only; Lightning's hyper-parameter dict is read as a plain dict by its name.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FORMATS = ("dcp", "lightning", "hf", "torch")
# Where a save keeps its weights, in the order looked for (Lightning: "state_dict").
WEIGHT_KEYS = ("state_dict", "model_state_dict", "model")


# Lightning's AttributeDict (a dict with attribute access), read as a plain dict by its name:
# nothing of Lightning is imported, and the restricted reader builds only a dict.
SAFE_BY_NAME = [
    (dict, "lightning.fabric.utilities.data.AttributeDict"),
    (dict, "lightning_fabric.utilities.data.AttributeDict"),
    (dict, "pytorch_lightning.utilities.parsing.AttributeDict"),
]


def export(src: str | Path, dst: str | Path, fmt: str = "dcp") -> None:
    """Write DST whole or not at all (a temporary file, then a rename)."""
    dst = Path(dst)
    tmp = dst.with_suffix(dst.suffix + ".tmp")
    if fmt == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(src), tmp)
    else:
        from safetensors.torch import save_file

        tensors = weights(Path(src), fmt)
        if not tensors:
            raise ValueError(f"no tensors found in {src}")
        # safetensors refuses tensors that share memory (tied weights): each gets its own.
        save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, tmp)
    tmp.replace(dst)


def weights(src: Path, fmt: str) -> dict[str, Any]:
    """The model's tensors of a framework save, by name."""
    if fmt == "hf":
        return _hf_weights(src)
    state = _safe_load(src)
    if isinstance(state, Mapping):
        for key in WEIGHT_KEYS:
            if isinstance(state.get(key), Mapping) and _tensors(state[key]):
                return _tensors(state[key])
    return _tensors(state)


def _safe_load(path: Path) -> Any:
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(SAFE_BY_NAME):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message runs to many lines of advice; one names what was refused.
        lines = [line.strip() for line in str(exc).splitlines()]
        refused = next((line for line in lines if "Unsupported global" in line), lines[-1])
        raise ValueError(
            f"{path.name} holds more than tensors and plain data, and a save is never "
            f"unpickled unrestricted here ({refused.split(' was not')[0][:300]})"
        ) from None


def _tensors(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor in nested dicts, by dotted key."""
    import torch

    if isinstance(value, torch.Tensor):
        return {prefix.rstrip("."): value}
    found: dict[str, Any] = {}
    if isinstance(value, Mapping):
        for key, inner in value.items():
            found.update(_tensors(inner, f"{prefix}{key}."))
    return found


def _hf_weights(src: Path) -> dict[str, Any]:
    """A Hugging Face checkpoint-N/ directory: its safetensors file(s), else its .bin."""
    from safetensors.torch import load_file

    shards = sorted(src.glob("model*.safetensors"))
    if shards:
        merged: dict[str, Any] = {}
        for shard in shards:
            merged.update(load_file(shard))
        return merged
    bins = sorted(src.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(
            f"no model weights (model*.safetensors, pytorch_model*.bin) in {src}"
        )
    merged = {}
    for shard in bins:
        merged.update(_tensors(_safe_load(shard)))
    return merged


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    fmt = "dcp"
    if len(args) == 4 and args[2] == "--format" and args[3] in FORMATS:
        fmt = args[3]
        args = args[:2]
    if len(args) != 2:
        print(
            "usage: python -m trainer.export SRC DST [--format dcp|lightning|hf|torch]",
            file=sys.stderr,
        )
        return 2
    try:
        export(*args, fmt=fmt)
    except (KeyboardInterrupt, SystemExit):
        raise
    # DCP's CheckpointException derives from BaseException, not Exception. The caller records
    # the last line: the reason, not a traceback.
    except BaseException as exc:
        lines = str(exc).strip().splitlines() or [""]
        print(f"{type(exc).__name__}: {lines[-1]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
