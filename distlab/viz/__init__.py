"""Pictures: the figures every chapter reuses, the ipywidgets calculator, the tour's report page.
plots (curves: its line plots), widgets, report; each takes measured records (theory beside them, labelled) and draws.
May import: engine, theory, meters.
"""
