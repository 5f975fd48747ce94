"""Benchmarks: tools that measure Baton (and its peers), not services. ``baton bench ...`` fronts them."""
