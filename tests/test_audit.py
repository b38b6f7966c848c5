"""The device audit: each defect class that breaks under NCCL is caught on CPU ranks."""
import json

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab.engine.launch import run_on_ranks
from distlab.engine.audit import lint_notebook, lint_source
from distlab.course.models import build_model, lm_loss, synthetic_batch


def _placed_training_step():
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = build_model("tiny")                        # on distlab.device() by default
    x, y = synthetic_batch(0, 4, model.config)         # likewise
    DDP(model)(x).sum().backward()
    flat = torch.zeros(sum(p.numel() for p in model.parameters()), device=model.tok.weight.device)
    dist.all_reduce(flat)
    sharded = build_model("tiny")
    fully_shard(sharded, mesh=distlab.mesh())
    lm_loss(sharded, x, y).backward()
    step = torch.tensor(0.0)          # 0-dim host scalars are fine (optimizers keep `step` so)
    return (flat.sum() + step).item()


def _host_batch():
    model = build_model("tiny")
    x = torch.zeros(4, model.config.seq_len, dtype=torch.long)   # no device: a CPU tensor on a GPU box
    return model(x).sum().item()


def _host_bucket_buffer():
    model = build_model("tiny")
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))   # the bucket forgot its device
    offset = 0
    for p in model.parameters():
        flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))   # copy_ across devices is legal ...
        offset += p.numel()
    dist.all_reduce(flat)                                               # ... the collective is not


def _host_tensor_into_all_reduce():
    t = torch.ones(16)
    dist.all_reduce(t)
    return t.tolist()


def _host_bucket_in_a_grad_hook():
    model = build_model("tiny")
    bucket = torch.zeros(model.tok.weight.numel())                   # made outside backward, without a device

    def reduce(grad):                                                 # runs inside backward(), as DDP's do
        bucket.copy_(grad.reshape(-1))
        dist.all_reduce(bucket)
        return grad
    model.tok.weight.register_hook(reduce)
    x, y = synthetic_batch(0, 4, model.config)
    lm_loss(model, x, y).backward()


def _meshless_fully_shard():
    from torch.distributed.fsdp import fully_shard
    fully_shard(build_model("tiny"))


def test_placed_code_passes_the_audit(no_orphans):
    out = run_on_ranks(_placed_training_step, 2, audit=True)
    assert out[0] == out[1]


@pytest.mark.parametrize("fn, words", [
    (_host_batch, ["embedding()", "shape (4, 16)", "_host_batch"]),
    (_host_bucket_buffer, ["collective all_reduce", "shape (34176,)", "_host_bucket_buffer"]),
    (_host_tensor_into_all_reduce, ["collective all_reduce", "shape (16,)", "_host_tensor_into_all_reduce"]),
    (_host_bucket_in_a_grad_hook, ["collective all_reduce", "_host_bucket_in_a_grad_hook"]),
    (_meshless_fully_shard, ["fully_shard() was called without mesh="]),
], ids=["device-less-batch", "device-less-bucket", "device-less-all-reduce", "device-less-bucket-in-backward",
        "fully-shard-without-mesh"])
def test_each_defect_class_is_caught_with_its_line(fn, words, no_orphans):
    with pytest.raises(distlab.RankFailed) as info:
        run_on_ranks(fn, 2, audit=True)
    assert info.value.exc_type == "DeviceAuditError"
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_the_same_defects_pass_silently_without_the_audit(no_orphans):
    # ... which is why the audit exists: on CPU ranks these bugs are invisible.
    # the right sums and the same logits on both ranks: nothing on a CPU rank says the tensors had no device
    assert run_on_ranks(_host_tensor_into_all_reduce, 2, audit=False) == [[2.0] * 16] * 2
    logits = run_on_ranks(_host_batch, 2, audit=False)
    assert logits[0] == logits[1] and logits[0] == logits[0] and abs(logits[0]) > 0   # finite, not NaN, not 0


def test_environment_variable_turns_the_audit_on(monkeypatch, no_orphans):
    monkeypatch.setenv("DISTLAB_DEVICE_AUDIT", "1")
    with pytest.raises(distlab.RankFailed, match="DeviceAuditError"):
        distlab.launch(_host_tensor_into_all_reduce, 2)


def test_bare_timers_in_notebook_code_are_found(tmp_path):
    assert lint_source("import time\nstart = time.perf_counter()\nx = 1\n")[0].startswith("line 2: time.perf_counter()")
    assert lint_source("from distlab.meters import time_call\nsecs = time_call(f, repeats=3)\n") == []
    nb = {"cells": [{"cell_type": "code", "id": "c0", "metadata": {}, "outputs": [], "execution_count": None,
                     "source": "t0 = time.time()\nstep()\nprint(time.time() - t0)"}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "seeded.ipynb"
    path.write_text(json.dumps(nb))
    problems = lint_notebook(path)
    assert len(problems) == 2 and problems[0].startswith("cell 0 line 1: time.time()")
