"""Chapter 7: a transformer laid out the way tensor parallelism cuts it, and its measurements.
model (the TP model, PyTorch's plans, per-group traffic), measure (the lecture's rank functions: TP, SP, CP and
2-D runs, and their one-process references). What DTensor does on this backend: `distlab doctor --run`.
May import: engine, theory (theory.tensor_parallel holds chapter 7's closed forms), meters, bench, course.
"""
