"""Chapters 4 and 5: the bookkeeping ZeRO-2 and ZeRO-3 are built on.
buckets (ZeRO-2's gradient buckets over one flat buffer), units (ZeRO-3's gathered-and-freed units).
May import: engine, theory, meters, bench, course.
"""
