"""Measurements taken on a rank: memory, communication, time, timelines, and the records runs write.
comm, memory, timing, timeline, dispatch (the modes they ride on), records (`distlab.record`).
May import: engine, theory (the comm meter books each call's algorithmic bytes by theory's ring formula).
"""
from distlab.meters.comm import CommStats, track_comm
from distlab.meters.memory import MemoryStats, ModelState, held_bytes, model_state, track_memory
from distlab.meters.timeline import Span, Timeline, profile_spans
from distlab.meters.timing import PhaseTimer, Throughput, sync, throughput, time_call

__all__ = ["CommStats", "track_comm", "MemoryStats", "ModelState", "held_bytes", "model_state", "track_memory",
           "Span", "Timeline", "profile_spans", "PhaseTimer", "Throughput", "sync", "throughput", "time_call"]
