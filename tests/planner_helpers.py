"""What the planner's tests (tests/test_planner*.py) share: `HAND`, a model shape whose terms are
easy by hand, Llama 70B's shape, and the planner's GiB."""

from trainer import planner

GiB = planner.GiB

# A shape whose terms are easy by hand: 10 layers of 1e8 parameters, a 1000 x 1000 embedding
# and (untied) head, s*b*h = 100 * 2 * 1000 = 200,000.
HAND = {"layers": 10, "hidden": 1000, "heads": 10, "vocab": 1000, "seq": 100, "micro_batch": 2}
HAND_NON_BLOCK = 2 * 1000 * 1000 + 2 * 1000  # embedding + head + final LayerNorm
HAND_PARAMS = 10**9 + HAND_NON_BLOCK

LLAMA_70B = {
    "params": 70 * 10**9,
    "layers": 80,
    "hidden": 8192,
    "heads": 64,
    "vocab": 128256,
    "seq": 4096,
}
