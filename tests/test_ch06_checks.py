"""Chapter 6's graded tasks pass the solution and reject wrong, cheating and hanging answers.

Each wrong answer runs only the case that exposes it (a launch costs seconds on 2 cores). That the stubs
fail every line is tests/test_labs.py's `test_unfilled_lab_fails_every_graded_line`, run for every lab.
"""
from __future__ import annotations

import time

import pytest

from distlab.checks import run_task
from distlab.checks.ch06 import TASKS, traffic
from labkit import answers, only, run

LAB = "06_fsdp"

NO_MESH = '''
def wrap(model, mesh, granularity="block", reshard_after_forward=None):
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model
'''
ROOT_ONLY = '''
def wrap(model, mesh, granularity="block", reshard_after_forward=None):
    fully_shard(model, mesh=mesh)
    return model
'''
# Ignores the mesh it is given: a 1-D mesh of every rank, so on the 2x2 mesh it shards 4 ways.
OWN_MESH = '''
def wrap(model, mesh, granularity="block", reshard_after_forward=None):
    own = distlab.mesh()
    for block in model.blocks:
        fully_shard(block, mesh=own, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=own, reshard_after_forward=reshard_after_forward)
    return model
'''
# No sharding at all: replicate and average the gradients with hooks. The values are right.
REPLICATE = '''
def wrap(model, mesh, granularity="block", reshard_after_forward=None):
    def average(p):
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average)
    return model
'''
# Rank 1 waits for a message rank 0 never sends; rank 0 then waits in FSDP's first all-gather.
HANG = '''
def wrap(model, mesh, granularity="block", reshard_after_forward=None):
    if dist.get_rank() == 1:
        dist.recv(torch.zeros(1, device=distlab.device()), src=0)
    fully_shard(model, mesh=mesh)
    return model
'''
WRONG_TRAFFIC = '''
def predict_traffic(psi, psi_root, replicas, shard_size, bytes_per_element=4):
    s, b = shard_size, bytes_per_element
    return {"all_gather": 2 * psi * b * (s - 1) / s, "reduce_scatter": psi * b * (s - 1) / s,
            "all_reduce": 2 * psi * b * (replicas - 1) / replicas}
'''
ALL_ON_IB = '''
def comm_seconds(psi, nodes, gpu, hsdp):
    t = predict_traffic(psi, 0, nodes if hsdp else 1, gpu.gpus_per_node if hsdp else nodes * gpu.gpus_per_node, 2)
    return sum(t.values()) / (gpu.ib_GBps * 1e9)
'''


def _lines(lines):
    return [str(line) for line in lines]


def _wrap_lines(source, world_size):
    ns = answers(LAB, replace={"wrap": source})
    return _lines(run_task(only(TASKS["wrap"], world_size), [ns.wrap]))


# The solution passing every line is solutions/06_fsdp.ipynb under nbval (every case of every check cell against
# its committed PASS lines) and tests/test_grading_class.py (graded as a learner's submission, sandboxed).


def test_fully_shard_without_a_mesh_is_refused(no_orphans):
    out = _wrap_lines(NO_MESH, 2)
    assert all(line.startswith("FAIL") for line in out), out
    assert "fully_shard() was called without mesh=" in out[0], out


def test_one_unit_for_every_granularity_fails_units_and_traffic(no_orphans):
    out = _wrap_lines(ROOT_ONLY, 2)
    assert out[0] == ("FAIL wrap, 2 ranks: units and mesh: granularity 'block': FSDP units [''], "
                      "expected every block and the root ('')")
    assert out[1].startswith("PASS wrap, 2 ranks: parameters"), out   # the values are right ...
    assert out[2].startswith("FAIL wrap, 2 ranks: traffic: rank 0, block, reshard_after_forward=None: "
                             "all_gather sent 68352 B in step 0, expected 119168 B"), out   # ... the wrapping is not


def test_ignoring_the_given_mesh_fails_on_the_2d_mesh(no_orphans):
    out = _wrap_lines(OWN_MESH, 4)
    assert out[0].startswith("FAIL wrap on a 2x2 mesh (HSDP), 4 ranks: parameters: rank 0: parameters live on "
                             "meshes [[[4], []]], expected all on the mesh wrap was given, shape [2, 2]"), out
    assert out[1].startswith("FAIL wrap on a 2x2 mesh (HSDP), 4 ranks: model states and traffic: rank 0, "
                             "block, reshard_after_forward=None: all_gather sent"), out


def test_replicating_instead_of_sharding_gets_the_values_and_nothing_else(no_orphans):
    out = _wrap_lines(REPLICATE, 2)
    assert out[0].startswith("FAIL wrap, 2 ranks: units and mesh: granularity 'block': FSDP units none"), out
    assert out[1].startswith("PASS wrap, 2 ranks: parameters"), out
    assert out[2].startswith("FAIL wrap, 2 ranks: traffic: rank 0, block, reshard_after_forward=None: all_gather "
                             "sent 0 B"), out


def test_a_hang_is_reported_in_seconds_and_stops_the_task(no_orphans, short_stall):
    ns = answers(LAB, replace={"wrap": HANG})
    start = time.monotonic()
    out = _lines(run(LAB, "wrap", ns))
    assert time.monotonic() - start < 60
    assert out[0].startswith(f"FAIL wrap, 2 ranks: units and mesh: hung: rank(s) [0, 1] waited {short_stall} s"), out
    assert "(case: wrap(model, mesh (2,), 'block', reshard_after_forward=None))" in out[0], out
    assert "every rank must call fully_shard on the same modules" in out[0], out
    assert all(line.endswith("not run: an earlier case (2 ranks) hung") for line in out[3:]), out


def test_wrong_formulas_fail(no_orphans):
    out = _lines(run(LAB, "predict_traffic", answers(LAB, replace={"predict_traffic": WRONG_TRAFFIC})))
    assert out[0] == ("FAIL predict_traffic: the lab's meshes (1x2, 1x4, 2x2, 4x1, one unit): Ψ=34176, Ψ_root=8768, "
                      "R=1, S=2, 4 B/element: all_gather 136704 B, expected 119168 B"), out
    assert out[1].startswith("FAIL"), out
    out = _lines(run(LAB, "comm_seconds", answers(LAB, replace={"comm_seconds": ALL_ON_IB})))
    assert out[0].startswith("FAIL comm_seconds: 7.5B on H100 nodes, FSDP vs HSDP: 7.5B params, 8 node(s) of H100, "
                             "HSDP"), out


def test_the_closed_form_special_cases():
    psi, root = 1000, 100
    fsdp, ddp = traffic(psi, root, 1, 4), traffic(psi, root, 4, 1)
    assert fsdp == {"all_gather": 1900 * 4 * 3 / 4, "reduce_scatter": 3000.0, "all_reduce": 0.0}
    assert ddp == {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 2 * 1000 * 4 * 3 / 4}   # DDP's 2Ψ(N-1)/N
    assert traffic(psi, root, 1, 4, reshard_after_forward=False)["all_gather"] == 1000 * 4 * 3 / 4
    assert sum(traffic(psi, 0, 1, 4, reshard_after_forward=True).values()) == pytest.approx(3 * 1000 * 4 * 3 / 4)
    assert list(TASKS) == ["wrap", "predict_traffic", "comm_seconds"]
    assert TASKS["predict_traffic"].answers == ("predict_traffic",)
