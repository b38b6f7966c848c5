"""Each chapter's support code, by topic: what its lecture and lab import beyond the engine.
models (the course GPT), collectives (ch 1), data_parallel (ch 2-3), zero (ch 4-5), tensor_parallel (ch 7),
pipeline, offload, planner (ch 8), stepwise (add_to_class).
May import: engine, theory, meters, bench, course.
"""
from distlab.engine.lazyimports import defer_rfc3987_syntax

# A lecture kernel that reads a lab notebook (`distlab.apps.simulate.lab_class`, chapters 6 and 9) imports
# nbformat, whose jsonschema would build rfc3987_syntax's ~40 grammars (~3 s of CPU) for a format no notebook
# uses: defer them, as the CLI and the pytest plugin do. A no-op once jsonschema is imported.
defer_rfc3987_syntax()
