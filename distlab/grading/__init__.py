"""`distlab grade`: instructors grade a class's lab notebooks; verdicts are never computed where learner code runs.
May import: engine, theory, meters, bench, course, checks, and the top-level `distlab`.

    lab.py          what the shipped lab grades (its check cells, parsed), its answer cells
    submission.py   a learner's notebook, read defensively: only its answer cells
    classrun.py     a class run: every submission, `--jobs` at a time; reports always written
    grade.py        one submission: run its answers (sandbox + runner), judge here, apply the evidence
    sandbox.py      bubblewrap around the runner (unprivileged uid, rlimits); the runner's result pipe (JSON lines)
    runner.py       inside the sandbox: drops root, launches every case's ranks, sends their records
    rankside.py     on each rank: audit hook, metered process group, seccomp, then PRELUDE + the learner's cells
    broker.py       a trusted process per rank that owns its real gloo groups, runs and books every op
    audithook.py    the hook: forwards every op to the broker (NCCL: runs it), streams evidence as it happens
    pgmeter.py      the metered ProcessGroup (holds no communicator) and the bytes it books
    seccomp.py      the kernel filter each rank installs once its group is up: no sockets, processes, sessions,
                    signals to others; no_dump: every process in the sandbox closed to its same-uid siblings' /proc
    shortcuts.py    each lab's library shortcut (lab 02: DDP, ...), found in the source and watched on the rank
    wire.py         a rank's outputs as safetensors + JSON (no pickle); resultcheck.py: their bounds, in a child
    safeload.py     the launcher's wrapper around a rank's outputs, read as plain data only
    evidence.py     reading a rank's stream and its broker's books: traffic per region, what learner code did
    report.py       grades.csv, grades.html, grades.md, junit.xml;  cli.py
    (distlab/apps/nbval_plugin.py: `pytest --nbval-lax --distlab-grade LAB handins/`, the same engine)
"""
