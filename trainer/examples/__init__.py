"""User scripts that run under Lockstep as they would under torchrun (docs/training.md)."""
