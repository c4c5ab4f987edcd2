"""Pricing: what a kernel or a whole model costs on the target (kernel prices, the graph stage's TVM
runner, the per-kernel profile, the sanity floor, the shipped build's per-layer profile)."""
