"""Lab 7's context-parallel checks (zig-zag ring attention, Ulysses) reject plausible mistakes: each wrong answer
fails the line that names it and passes the others. One 2-rank launch per mistake; the balance and traffic
verdicts are also judged directly on made-up rank outputs (no launch)."""
from __future__ import annotations

from distlab.checks.ch07 import TASKS
from distlab.checks.ch07_cp import pair_flops
from distlab.meters import CommStats

from test_ch07_checks import _first_case, _status

ZIGZAG_WITHOUT_DIAGONAL_MASK = '''
def zigzag_ring_attention(q, k, v):
    r, cp = dist.get_rank(), dist.get_world_size()
    c = q.shape[-2] // 2
    mine, qs = (r, 2 * cp - 1 - r), (q[..., :c, :], q[..., c:, :])
    outs = [torch.zeros_like(x) for x in qs]
    lses = [torch.full_like(x[..., :1], float("-inf")) for x in qs]
    kv = torch.stack([k, v])
    for step in range(cp):
        works, incoming = [], None
        if step < cp - 1:
            incoming = torch.empty_like(kv)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % cp),
                                            dist.P2POp(dist.irecv, incoming, (r - 1) % cp)])
        src = (r - step) % cp
        for i, qi in enumerate(mine):
            for j, kj in enumerate((src, 2 * cp - 1 - src)):
                if kj > qi:
                    continue
                o, l = block_attention(qs[i], kv[0][..., j * c:(j + 1) * c, :], kv[1][..., j * c:(j + 1) * c, :],
                                       causal=False)
                outs[i], lses[i] = merge(outs[i], lses[i], o, l)
        for w in works:
            w.wait()
        kv = incoming if incoming is not None else kv
    return torch.cat(outs, dim=-2)
'''

# The output stays in the head layout's order: the tokens come back, but as one rank's heads.
HEADS_TO_SEQ_WITHOUT_ALL_TO_ALL = '''
def heads_to_seq(x):
    cp = dist.get_world_size()
    b, a, s, d = x.shape
    return x.reshape(b, a, cp, s // cp, d)[:, :, dist.get_rank()].repeat(1, cp, 1, 1)
'''


def test_zigzag_without_the_diagonal_mask_fails_values_only():
    assert _status(_first_case("zigzag", zigzag_ring_attention=ZIGZAG_WITHOUT_DIAGONAL_MASK)) == ["FAIL", "PASS", "PASS"]


def test_ulysses_without_the_return_all_to_all_fails_attention_and_traffic():
    assert _status(_first_case("ulysses", heads_to_seq=HEADS_TO_SEQ_WITHOUT_ALL_TO_ALL)) == ["PASS", "FAIL", "FAIL"]


def _judge(task, case, outputs):
    return [(line.ok, line.detail) for line in task.judge(case, outputs, None)]


def test_zigzag_balance_and_traffic_verdicts():
    task = TASKS["zigzag"]
    case = task.cases()[0]                                   # 2 ranks
    want_send = 2 * (2 - 1) / 2 * 2 * 32 * 64 * 4             # 2(cp-1)/cp x B S h e, fp32
    good = CommStats(calls={"send": 1, "recv": 1}, bytes={"send": int(want_send), "recv": 0})
    plain = [{"out": None, "comm": good, "flops": n * pair_flops(2)} for n in (3, 7)]     # the plain ring's 1 + 2 ...
    balance = task.judge(case, plain, {0: None, 1: None})[2]
    assert not balance.ok and "unbalanced" in balance.detail
    wasteful = [{"out": None, "comm": good, "flops": 8 * pair_flops(2)} for _ in range(2)]   # every pair, masked
    balance = task.judge(case, wasteful, {0: None, 1: None})[2]
    assert not balance.ok and "suffice" in balance.detail
    right = [{"out": None, "comm": good, "flops": 5 * pair_flops(2)} for _ in range(2)]
    lines = task.judge(case, right, {0: None, 1: None})
    assert [line.ok for line in lines[1:]] == [True, True]
    gathered = CommStats(calls={"all_gather": 1}, bytes={"all_gather": int(want_send)})
    traffic = task.judge(case, [{"out": None, "comm": gathered, "flops": 0}] * 2, {0: None, 1: None})[1]
    assert not traffic.ok and "only sends and receives" in traffic.detail


def test_ulysses_judges_four_all_to_alls():
    task = TASKS["ulysses"]
    case = task.cases()[1]                                   # 4 ranks
    one = int(3 / 4 * 2 * 8 * 32 // 4 * 8 * 4)
    ok = CommStats(calls={"all_to_all": 4}, bytes={"all_to_all": 4 * one})
    three = CommStats(calls={"all_to_all": 3}, bytes={"all_to_all": 3 * one})
    assert task.judge(case, [{"heads": [], "out": None, "comm": ok}] * 4, {})[2].ok
    assert not task.judge(case, [{"heads": [], "out": None, "comm": three}] * 4, {})[2].ok
