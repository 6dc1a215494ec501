"""Speed and verdict benchmarks (importable so that `benchmarks.torch_probe:NAME` resolves)."""
