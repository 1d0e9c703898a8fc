"""Reference models used by tests, benchmarks and demos."""

from .reference_dit import DiTBlock, DiTConfig, ReferenceDiT, example_inputs, reference_dit

__all__ = ["DiTBlock", "DiTConfig", "ReferenceDiT", "example_inputs", "reference_dit"]
