"""Chapter 7: a transformer laid out the way tensor parallelism cuts it, and what DTensor does on this backend.
model (the TP model, PyTorch's plans, per-group traffic), dtensor_probe (DTensor features, measured),
measure (the lecture's rank functions: activations, TP, SP, CP and 2-D runs, and their one-process references).
May import: engine, theory (theory.tensor_parallel holds chapter 7's closed forms), meters, bench, course.
"""
