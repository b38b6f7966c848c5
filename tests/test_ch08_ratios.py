"""Issue 25 at a reduced size: a pipeline stage's peak activations, measured on 2 ranks, within 5 % of
the model (micro-batches in flight + one backward's transient, measured apart); 1F1B's peak below
GPipe's once m > p; and the bubble of both schedules against the table simulated with the hop, the gap
and the late receiver's round trip measured apart (`hop_s`): a ratio of timings on a shared 2-core box,
held to 15 % (a model without the hop and the gap, the closed form, misses by about that at this size)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab.course.pipeline.measure import bubble_of, hop_s, predicted_bubble, sweep
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
    cost, m, orders = 0.02, 4, {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}
    costs = distlab.launch(hop_s, 2, args=(_runner(), one_f_one_b_order, cost, 3), backend="gloo", stall=120)[0]
    assert costs["hop"] > 0 and costs["gap"] > 0 and costs["late"] > 0
    per_rank = distlab.launch(sweep, 2, args=(_runner(), orders, (m,), cost, 3), backend="gloo", stall=120)
    for name, order in orders.items():
        model = predicted_bubble(order, 2, m, cost, costs["hop"], costs["gap"], costs["late"])
        # a timing ratio on a shared box: a descheduled rank stalls a step and nearly always adds idle time, so
        # the bound above is loose; the model must not over-predict: the bound below is the tight one
        ratio = bubble_of(per_rank, name, m) / model
        assert 0.85 < ratio < 1.6, (name, ratio, costs)


def test_torch_multi_chunk_bubbles_within_their_own_tables():
    # PyTorch's interleaved and ZBV schedules on 2 ranks (v = 2): their own tables (torch_order) simulated with free
    # messages give the interleaved closed form. The model adds PyTorch's hop and gap (measured apart on
    # ScheduleGPipe, m = 1), its late receiver (Schedule1F1B, m = 2: late_of), where the lowered table posts each
    # receive (torch_posts) and each action's cost as it ran (action_costs: ZBV's stage 0 computes no input
    # gradient, its W carries the whole backward). A timing ratio on a shared 2-core box, where a descheduled rank
    # stalls a step by tens of ms and nearly always adds idle time: under a load of 5-7 the median of 5 steps ran up to
    # 1.6 times the model, their least 0.9-1.3 times it (1.47 once, in a full suite beside other work). So the least
    # of 5 steps, bounded tightly below and loosely above; the closed form, which leaves the messages out, is
    # below the model (checked without timing).
    from distlab.course.pipeline.measure import (action_costs, late_of, message_costs, overheads_of, torch_order,
                                                 torch_posts, torch_schedules)
    from distlab.course.pipeline.simulate import simulate
    from distlab.course.pipeline.stages import bubble
    cost, m, names = 0.02, 4, {"ScheduleInterleaved1F1B": 2, "ScheduleZBVZeroBubble": 2}
    tor = distlab.launch(torch_schedules, 2, args=(names, m, cost), kwargs=dict(repeats=5), backend="gloo", stall=120)
    apart = distlab.launch(torch_schedules, 2, args=({"ScheduleGPipe": 1}, 1, cost), kwargs=dict(repeats=3), backend="gloo", stall=120)
    late = distlab.launch(torch_schedules, 2, args=({"Schedule1F1B": 1}, 2, cost), kwargs=dict(repeats=5), backend="gloo", stall=120)
    costs = overheads_of(apart, "ScheduleGPipe")
    spent = action_costs(tor, "ScheduleZBVZeroBubble")                    # rank 0 holds stages 0 and 3
    assert spent("B", 0, 0) < 0.25 * cost / 2 < 1.5 * cost / 2 < spent("W", 0, 0), (spent("B", 0, 0), spent("W", 0, 0))
    assert spent("B", 0, 3) > 0.75 * cost / 2
    for name, v in names.items():
        order, stage_of = torch_order(tor, name)
        kw = dict(t_f=cost, t_b=cost, t_w=cost, v=v, stage_of=stage_of)
        if name == "ScheduleInterleaved1F1B":
            assert bubble(simulate(order, 2, m, **kw)) == pytest.approx(pt.bubble_fraction(2, m, v=2))
        model = bubble(simulate(order, 2, m, t_p2p=costs["hop"], t_gap=costs["gap"], t_late=late_of(late),
                                posts=torch_posts(tor, name), cost_of=action_costs(tor, name), **kw))
        per_step = [bubble([s for o in tor for s in o[name]["steps"][k]]) for k in range(5)]
        if name == "ScheduleInterleaved1F1B":     # the messages grow the bubble past the closed form
            assert model > pt.bubble_fraction(2, m, v=2) + 0.01, (model, costs)
        # the least of 5 steps (a stall only adds idle time): tight below, loose above (a full suite beside other
        # work on this box ran the interleaved one to 1.47 times its model)
        assert 0.65 < min(per_step) / model < 2.0, (name, per_step, model, costs)
        # the lecture's model: the same terms read off the schedule's own steps (message_costs), the same bounds
        paired = message_costs(tor, name)
        assert paired["hop"] > 0 and paired["gap"] > 0, paired
        model = bubble(simulate(order, 2, m, t_p2p=paired["hop"], t_gap=paired["gap"],
                                t_late=paired["late"] if paired["late"] is not None else late_of(late),
                                posts=torch_posts(tor, name), cost_of=action_costs(tor, name), **kw))
        assert 0.65 < min(per_step) / model < 2.0, (name, per_step, model, paired)
