"""The lectures' measurement modules (chapters 7 and 8): documented, typed, and their pure parts right.

The rank functions themselves run in the lectures (notebooks/07 and 08, under nbval); here only what
needs no launch: every public function says what it measures and is annotated, the readers of a
pipeline sweep compute the bubble and timings from known timelines, and the one-process references
train on the CPU.
"""
from __future__ import annotations

import inspect
import math

import pytest

from distlab.course.pipeline import bubble, calibration, fixed_cost, mesh3d, offloaded, pipelining, stages
from distlab.course.pipeline import measure as pp_measure
from distlab.course.pipeline import runner as pp_runner
from distlab.course.tensor_parallel import dropout_rng, measure_cp
from distlab.course.tensor_parallel import measure as tp_measure
from distlab.meters import Span


def _public_functions(module):
    return [f for name, f in vars(module).items()
            if inspect.isfunction(f) and not name.startswith("_") and f.__module__ == module.__name__]


@pytest.mark.parametrize("module", [tp_measure, measure_cp, dropout_rng, pp_runner, pipelining, offloaded, calibration,
                                    stages, fixed_cost, bubble],
                         ids=["tensor_parallel", "context_parallel", "dropout_rng", "pipeline runner",
                              "pipelining", "offload", "calibration", "stages", "fixed_cost", "bubble"])
def test_every_function_is_documented_and_typed(module):
    functions = _public_functions(module)
    assert functions
    for f in functions:
        assert inspect.getdoc(f), f"{module.__name__}.{f.__name__} has no docstring"
        sig = inspect.signature(f)
        missing = [p for p in sig.parameters if sig.parameters[p].annotation is inspect.Parameter.empty]
        assert not missing, f"{f.__name__}: parameters without a type: {missing}"
        assert sig.return_annotation is not inspect.Signature.empty, f"{f.__name__}: no return type"


def _sweep_result():
    """Two ranks, one schedule, m = 2, one repeat: rank 0 works 0-2 and 4-6, rank 1 works 1-5 (of 0-6)."""
    rank0 = [Span(0, "F0", "compute", 0.0, 1.0), Span(0, "F1", "compute", 1.0, 2.0),
             Span(0, "B0", "compute", 4.0, 5.0), Span(0, "B1", "compute", 5.0, 6.0)]
    rank1 = [Span(1, "F0", "compute", 1.0, 2.0), Span(1, "B0", "compute", 2.0, 3.0),
             Span(1, "F1", "compute", 3.0, 4.0), Span(1, "B1", "compute", 4.0, 5.0)]
    return [{("1f1b", 2): [{"spans": rank0, "peak": 0}]}, {("1f1b", 2): [{"spans": rank1, "peak": 0}]}]


def test_bubble_and_timing_read_a_sweep():
    per_rank = _sweep_result()
    # each rank works 4 of the 6 seconds of the step: a third idle
    assert pp_measure.bubble_of(per_rank, "1f1b", 2) == pytest.approx(1 / 3)
    m, step_s, busy_s = pp_measure.timing_of(per_rank, "1f1b", 2)
    assert (m, step_s, busy_s) == (2, pytest.approx(6.0), pytest.approx(2.0))
    assert pp_runner.step_bubbles(per_rank, "1f1b", 2) == [pytest.approx(1 / 3)]


def test_one_hop_is_read_off_the_one_micro_batch_steps():
    # 2 ranks, m = 1, F = 1, B = 2: rank 1's F starts 0.25 after rank 0's ends, rank 0's B 0.25 after rank 1's B:
    # window 6.5 = 2 x 3 of work + 2 messages of 0.25
    rank0 = [Span(0, "F0", "compute", 0.0, 1.0), Span(0, "B0", "compute", 4.5, 6.5)]
    rank1 = [Span(1, "F0", "compute", 1.25, 2.25), Span(1, "B0", "compute", 2.25, 4.25)]
    per_rank = [{("gpipe", 1): [{"spans": rank0}]}, {("gpipe", 1): [{"spans": rank1}]}]
    assert pp_runner.hop_of(per_rank, "gpipe") == pytest.approx(0.25)
    with pytest.raises(ValueError):
        pp_runner.hop_of(per_rank[:1], "gpipe")


def test_the_old_names_stay_importable_from_measure():
    # solutions/08 imports predicted_bubble and runner_message_costs, tests copies_inside, from `measure`
    for name in ("predicted_bubble", "runner_message_costs", "copies_inside", "sweep", "bubble_of", "reference_bf16"):
        assert callable(getattr(pp_measure, name)), name
    assert pp_measure.reference_bf16 is mesh3d.reference_bf16


def test_the_one_process_references_train_on_the_cpu():
    losses = tp_measure.one_process_losses("tp-tiny", 2, 2)
    adam = tp_measure.one_process_losses("tp-tiny", 2, 2, adam=True)
    bf16 = pp_measure.reference_bf16(2, 4, 1e-2, n_layers=2)
    for series in (losses, adam, bf16):
        assert len(series) == 2 and all(math.isfinite(v) for v in series)
    assert losses[0] == adam[0]          # the same model, the same first batch: only the update differs
