"""Each chapter's support code, by topic: what its lecture and lab import beyond the engine.
models (the course GPT), collectives (ch 1), data_parallel (ch 2-3), zero (ch 4-5), tensor_parallel (ch 7),
pipeline, offload, planner (ch 8), stepwise (add_to_class).
May import: engine, theory, meters, bench, course.
"""
