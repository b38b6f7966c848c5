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
