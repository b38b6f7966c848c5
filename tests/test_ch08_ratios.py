"""Chapter 8 at a reduced size: a pipeline stage's peak activations, measured on 2 ranks, within 5 % of
the model (micro-batches in flight + one backward's transient, measured apart); 1F1B's peak below
GPipe's once m > p; the bubble of both schedules against the table simulated with one hop cost read off
the m = 1 steps (`hop_of`): a ratio of timings on a shared 2-core box, so loose bounds; and PyTorch's
multi-chunk schedules run from the lecture's rank function give one process's loss and their own tables."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab.course.models import synthetic_batch
from distlab.course.pipeline.runner import bubble_of, hop_of, predicted_bubble, sweep
from distlab.course.pipeline.simulate import gpipe_order, one_f_one_b_order
from distlab.theory import pipeline as pt


def _runner():
    from distlab.course.pipeline.stages import stage_loss

    class Runner:                                         # the lecture's PipelineRunner, condensed
        def __init__(self, stage, *, prev, next, shape, dtype=torch.float32):
            self.stage, self.prev, self.next, self.shape, self.dtype = stage, prev, next, shape, dtype

        def _exchange(self, sends, recv_from):
            buf = None if recv_from is None else torch.empty(self.shape, dtype=self.dtype, device=distlab.device())
            ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
            if buf is not None:
                ops.append(dist.P2POp(dist.irecv, buf, recv_from))
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()
            return buf

        def step(self, schedule, m, x=None, y=None):
            first, last = self.prev is None, self.next is None
            xs, ys = (None if x is None else x.chunk(m)), (None if y is None else y.chunk(m))
            stash, pending = {}, []
            for kind, i in schedule:
                if kind == "F":
                    buf = self._exchange(pending, None if first else self.prev)
                    inp = xs[i] if first else buf.requires_grad_()
                    out = self.stage(inp)
                    if last:
                        out = stage_loss(out, ys[i]) / m
                    stash[i] = (inp, out)
                    pending = [] if last else [(out.detach(), self.next)]
                else:
                    grad = self._exchange(pending, None if last else self.next)
                    inp, out = stash.pop(i)
                    out.backward() if last else out.backward(grad)
                    pending = [] if first else [(inp.grad, self.prev)]
            self._exchange(pending, None)
    return Runner


def test_peak_activations_within_five_percent_of_the_model():
    m = 4
    per_rank = distlab.launch(sweep, 2,
                              args=(_runner(), {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}, (m,), 0.001, 1),
                              backend="gloo")
    peaks = {}
    for name in ("gpipe", "1f1b"):
        for r, rank in enumerate(per_rank):
            measured = max(run["peak"] for run in rank[name, m]) / rank["unit"]
            model = pt.peak_activations(name, 2, m, r, rank["transient"] / rank["unit"])
            assert measured / model == pytest.approx(1, abs=0.05), (name, r, measured, model)
            peaks[name, r] = measured
    assert peaks["1f1b", 0] < peaks["gpipe", 0] - 1                # m > p: 1F1B holds fewer


def test_peak_activations_adds_the_transient():
    assert pt.peak_activations("1f1b", 4, 8, 0, 0.5) == 4.5
    assert pt.peak_activations("gpipe", 4, 8, 3) == 8
    with pytest.raises(ValueError):
        pt.peak_activations("gpipe", 4, 8, 3, -1)


def test_bubble_within_the_simulated_table():
    cost, orders = 0.02, {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}
    per_rank = distlab.launch(sweep, 2, args=(_runner(), orders, (1, 4), cost, 3), backend="gloo", stall=120)
    hop = hop_of(per_rank, "gpipe")                       # m = 1: F, F, B, B in a row plus 2 messages
    assert 0 < hop < cost, hop
    for name, order in orders.items():
        model = predicted_bubble(order, 2, 4, cost, hop)
        assert model > pt.bubble_fraction(2, 4)           # the messages lengthen the ramp
        # a timing ratio on a shared box: a descheduled rank stalls a step and nearly always adds idle time, so
        # the bound above is loose; one hop cost leaves out the late receiver's round trip: the bound below too
        ratio = bubble_of(per_rank, name, 4) / model
        assert 0.8 < ratio < 1.6, (name, ratio, hop)


def _torch_schedule(name, v, m, cost, repeats):
    """The lecture's rank function: PyTorch's schedule on the 8-block model, v chunks per rank."""
    from torch.distributed.pipelining import PipelineStage, schedules

    from distlab.course.pipeline.pipelining import run_steps, timed
    from distlab.course.pipeline.fixed_cost import FixedCost
    from distlab.course.pipeline.stages import build_stage, stage_loss
    from distlab.meters import Timeline
    r, p = distlab.rank(), distlab.world_size()
    n = p * v
    chunks = [r, n - 1 - r] if name == "ScheduleZBVZeroBubble" else [r + k * p for k in range(v)]
    stages = [build_stage("tiny", c, n, n_layers=8) for c in chunks]
    tl = Timeline()
    pstages = [timed(PipelineStage(FixedCost(s, cost / v, cost / v, cost / v), c, n, distlab.device()), tl)
               for s, c in zip(stages, chunks)]
    sched = getattr(schedules, name)(pstages[0] if v == 1 else pstages, n_microbatches=m, loss_fn=stage_loss)
    x, y = synthetic_batch(0, 2 * m, stages[0].config)
    return run_steps(sched, stages, chunks, tl, args=(x,) if 0 in chunks else (),
                     kwargs={"target": y, "losses": []} if n - 1 in chunks else {}, repeats=repeats)


def test_torch_multi_chunk_schedules_match_one_process_and_their_own_tables():
    from distlab.course.models import build_model, lm_loss
    from distlab.course.pipeline.pipelining import torch_order
    from distlab.course.pipeline.simulate import simulate
    from distlab.course.pipeline.bubble import bubble
    cost, m = 0.02, 4
    whole = build_model("tiny", n_layers=8, device="cpu")
    x, y = synthetic_batch(0, 2 * m, whole.config, device="cpu")
    ref = lm_loss(whole, x, y).item()
    for name in ("ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"):
        tor = distlab.launch(_torch_schedule, 2, args=(name, 2, m, cost, 3), backend="gloo", stall=120)
        loss = next(o["loss"] for o in tor if o["loss"] is not None)
        assert loss == pytest.approx(ref, rel=1e-5)
        assert sum(o["comm"].calls.get("send", 0) for o in tor) > 0
        order, stage_of = torch_order(tor)
        table = bubble(simulate(order, 2, m, t_f=cost, t_b=cost, t_w=cost, v=2, stage_of=stage_of))
        if name == "ScheduleInterleaved1F1B":
            assert table == pytest.approx(pt.bubble_fraction(2, m, v=2))
        # the least of 3 steps against the table with free messages: messages, PyTorch's own work and ZBV's
        # uneven split (stage 0 computes no input gradient, its W the whole backward) only add idle time. No bound
        # above: on a shared 2-core box a descheduled rank stalls a step by tens of ms (0.36 against 0.11 seen)
        least = min(bubble([s for o in tor for s in o["steps"][k]]) for k in range(3))
        assert least > 0.8 * table, (name, least, table)
