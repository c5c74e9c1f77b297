"""Backends that read memory (CPU live-storage tracker, CUDA allocator) and attribution to categories."""
