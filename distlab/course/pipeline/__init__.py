"""Chapter 8's pipelines: the course GPT cut into stages, stand-in kernel costs, and the schedule figures.
stages (stages, activation shapes, bubble read off a timeline), plots (schedules, bubble vs m, activations),
measure (the lecture's rank functions: schedule checks and sweeps, PyTorch's schedules, offload, the 3-D mesh).
May import: engine, theory (theory.pipeline holds the closed forms), meters, bench, course.
"""
