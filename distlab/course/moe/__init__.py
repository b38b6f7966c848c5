"""Chapter 10: mixture of experts and expert parallelism.
layer (the router, top-k gates, capacity, the router losses, MoE blocks in the course GPT: the one-process
reference), pictures (tokens flowing to experts across ranks, the all-to-all's splits, load histograms),
measure (the lecture's harness: load over steps, dropless vs capacity timing, the simulated layout).
The expert-parallel code itself (dispatch, combine, the EP layer) is written in the lecture and the lab.
May import: engine, theory (theory.moe holds chapter 10's closed forms), meters, bench, course.
"""
