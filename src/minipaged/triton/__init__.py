"""The `triton` backend. The kernels live in ops.py (imported by the registry on
first use), so importing this package does not import triton."""
