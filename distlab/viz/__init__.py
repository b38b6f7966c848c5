"""Pictures: the figures every chapter reuses, the ipywidgets calculator, the tour's report page.
plots (with curves: line plots, and peaks: a step's peak over what stays), widgets, report; each takes
measured records (theory beside them, labelled) and draws.
May import: engine, theory, meters.
"""
