"""Measurement harnesses: implementations raced in alternation (race), busbw sweeps (collectives), launch times.
The tour runs the last two from the package; chapters race their strategies with the first.
May import: engine, theory, meters.
"""
