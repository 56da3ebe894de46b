"""Pallas GPU kernels of jkv (compiled on GPU, ``interpret=True`` elsewhere).

Lowering choices live in :mod:`pallas_kernels.lowering` only.
"""
