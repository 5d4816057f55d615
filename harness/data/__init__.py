"""Inputs: length distributions and files (``workloads``), the synthetic training corpus (``corpus``) and the
scheduler's edge cases with their upstream differential (``edge_cases``).
"""
