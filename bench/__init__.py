"""Benchmarks: the model (PyTorch eager vs ONNX Runtime graph variants) and the server.

`python -m bench` runs both in one process on one machine with one thread count, prints a table
and writes JSON (docs/performance.md shows a run and how to read it).
"""
