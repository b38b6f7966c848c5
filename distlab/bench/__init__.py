"""Infrastructure benchmarks the tour runs from the package: launcher, collectives."""
