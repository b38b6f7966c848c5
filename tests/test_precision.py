"""MixedPrecisionAdam: same arithmetic as AdamW, fp32 state, 2+2+12 bytes/param."""
from __future__ import annotations

import pytest
import torch

from distlab.meters import model_state
from distlab.course.models import build_model, lm_loss, num_params, synthetic_batch
from distlab.engine.precision import MixedPrecisionAdam
from distlab.theory import MIXED_ADAM


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    for step in range(steps):
        x, y = synthetic_batch(step, 4, model.config)
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_matches_adamw_on_fp32_params():
    a, b = build_model("tiny", seed=1), build_model("tiny", seed=1)
    _train(a, torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, foreach=False))
    _train(b, MixedPrecisionAdam(b.parameters(), lr=1e-2, weight_decay=0.1))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa, atol=1e-6, rtol=1e-5, msg=name)


def test_bf16_model_fp32_state_and_sixteen_bytes_per_param():
    model = build_model("tiny").to(torch.bfloat16)
    opt = MixedPrecisionAdam(model.parameters(), lr=1e-2)
    _train(model, opt, steps=1)
    x, y = synthetic_batch(1, 4, model.config)
    lm_loss(model, x, y).backward()  # grads present, as between backward and step
    psi = num_params(model)
    st = model_state(model, optimizer=opt)
    assert (st.params, st.grads, st.optimizer_state) == (2 * psi, 2 * psi, 12 * psi)
    assert st.total == MIXED_ADAM.total * psi
    for p in model.parameters():
        s = opt.state[p]
        assert p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16
        assert {s["master"].dtype, s["exp_avg"].dtype, s["exp_avg_sq"].dtype} == {torch.float32}
        # The bf16 weight is the master rounded to bf16.
        assert torch.equal(p.detach(), s["master"].to(torch.bfloat16))


def test_master_keeps_updates_too_small_for_bf16():
    # 1.0 + 1e-4 rounds back to 1.0 in bf16 (8 bits of mantissa); the master keeps it.
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MixedPrecisionAdam([p], lr=1e-4, weight_decay=0.0)
    for _ in range(3):
        p.grad = -torch.ones_like(p)
        opt.step()
    assert torch.equal(p.detach(), torch.ones_like(p))
    torch.testing.assert_close(opt.master_params()[0], torch.full((4,), 1 + 3e-4), atol=1e-6, rtol=0)


def test_skips_params_without_grad_and_state_is_lazy():
    model = build_model("tiny").to(torch.bfloat16)
    model.pos.weight.requires_grad_(False)
    opt = MixedPrecisionAdam(model.parameters(), lr=1e-2)
    assert len(opt.state) == 0  # nothing before the first step, like torch's Adam
    frozen = model.pos.weight.detach().clone()
    _train(model, opt, steps=1)
    assert model.pos.weight not in opt.state
    assert torch.equal(model.pos.weight.detach(), frozen)
    assert len(opt.master_params()) == len([p for p in model.parameters() if p.requires_grad])


def test_state_dict_round_trip():
    model = build_model("tiny").to(torch.bfloat16)
    opt = MixedPrecisionAdam(model.parameters(), lr=1e-2)
    _train(model, opt, steps=2)
    again = MixedPrecisionAdam(model.parameters(), lr=1e-2)
    again.load_state_dict(opt.state_dict())
    p = next(model.parameters())
    assert again.state[p]["step"] == 2
    assert torch.equal(again.state[p]["master"], opt.state[p]["master"])


@pytest.mark.parametrize("kwargs", [dict(lr=-1.0), dict(betas=(0.9, 1.0)), dict(eps=-1e-8)])
def test_rejects_bad_hyperparameters(kwargs):
    with pytest.raises(ValueError):
        MixedPrecisionAdam([torch.nn.Parameter(torch.ones(2))], **kwargs)


# ---- chapter 3's model of a low-precision gradient reduction (distlab.theory.precision) ---------------------

def test_unit_roundoff_and_the_bound_above_the_rms_model():
    from distlab.theory.precision import reduction_error_bound, reduction_error_rms, unit_roundoff
    assert (unit_roundoff(torch.bfloat16), unit_roundoff(torch.float16), unit_roundoff(torch.float32)) == (
        2.0**-8, 2.0**-11, 2.0**-24)
    assert reduction_error_bound(4, torch.bfloat16) == 4 * 2.0**-8          # 3 additions + the cast
    assert reduction_error_bound(4, torch.float32) == 3 * 2.0**-24          # no cast
    for n in (2, 4, 8, 64):
        assert reduction_error_rms(n, torch.bfloat16) < reduction_error_bound(n, torch.bfloat16)
    # sqrt(N) growth: 8x the ranks, about 2x the error (not 8x)
    assert 1.5 < reduction_error_rms(64, torch.bfloat16) / reduction_error_rms(8, torch.bfloat16) < 3.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_rms_model_matches_a_ring_summed_in_one_process(dtype):
    # a ring's additions, in order, each rounded to the reduce dtype (elementwise ops: fast without native bf16)
    from distlab.theory.precision import reduction_error_rms
    gen = torch.Generator().manual_seed(0)
    for n in (2, 4, 8):
        g = torch.randn(n, 2**15, generator=gen)
        acc = g[0].to(dtype)
        for k in range(1, n):
            acc = acc + g[k].to(dtype)
        exact = g.double().sum(0)
        err = ((acc.double() - exact).norm() / exact.norm()).item()
        assert err == pytest.approx(reduction_error_rms(n, dtype), rel=0.2), (n, err)
