"""Chapter 8's pipelines: the course GPT cut into stages, stand-in kernel costs, and the schedule figures.
stages (stages, activation shapes, bubble read off a timeline), plots (schedules, bubble vs m, activations).
May import: engine, theory (theory.pipeline holds the closed forms), meters, bench, course.
"""
