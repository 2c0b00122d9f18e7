"""Where tensors live: host allocator, buffer pools, and the device / host / NVMe tiers.

Nothing here knows what a model or an optimizer is (shared/DESIGN.md, "tiers").
"""
