"""The engine: ranks and their rules (launch, the rank's runtime, processes, the device audit, strict: NCCL's rules).
Everything a rank needs before any chapter: which backend and device, quick mode, the version-safe collectives.
May import: nothing else in distlab (every other layer builds on this one).
"""
