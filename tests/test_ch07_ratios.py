"""Chapter 7's measured / predicted ratios (issue 25), each held at a reduced size on gloo ranks:
the peak bytes of a tensor-parallel training step (`lm_train_peak_bytes`) under the lecture's own plan, and, with the lecture's own ring attention
read from the notebook, the peak of its forward (`ring_attention_forward_peak_bytes`) and the bytes `RingAttention`
keeps for backward (`ring_attention_activation_bytes`)."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

import distlab
from distlab.theory import tensor_parallel as th

ROOT = Path(__file__).resolve().parents[1]
LECTURE = ROOT / "notebooks" / "07_tensor_parallel_lecture.ipynb"


def lecture_ring() -> types.ModuleType:
    """The lecture's ring attention cells (block_attention ... RingAttention), executed as a module."""
    import cloudpickle
    cells = ["".join(c["source"]) for c in json.loads(LECTURE.read_text())["cells"] if c["cell_type"] == "code"]
    first = next(i for i, s in enumerate(cells) if s.startswith("def block_attention"))
    last = next(i for i, s in enumerate(cells) if "class RingAttention" in s)
    mod = types.ModuleType("ch07_lecture_ring")
    sys.modules[mod.__name__] = mod
    exec("import math\nimport torch\nimport torch.distributed as dist\n"
         "from distlab.course.tensor_parallel.model import attention_core\n"
         + "\n\n".join(s for s in cells[first:last + 1] if s.startswith(("def ", "class "))), mod.__dict__)
    cloudpickle.register_pickle_by_value(mod)
    return mod


def lecture_tp() -> types.ModuleType:
    """The lecture's tensor-parallel cells (`block_plan`, then `parallelize` and `my_tokens`, and the dropout RNG
    tracker `TPRegionRNG`), executed as a module: the package's harness takes them as arguments, as the lecture
    passes them."""
    import cloudpickle
    cells = ["".join(c["source"]) for c in json.loads(LECTURE.read_text())["cells"] if c["cell_type"] == "code"]
    mod = types.ModuleType("ch07_lecture_tp")
    sys.modules[mod.__name__] = mod
    exec("import torch", mod.__dict__)
    for marker in ("def block_plan(", "def parallelize(", "class TPRegionRNG"):
        exec(next(s for s in cells if marker in s), mod.__dict__)
    cloudpickle.register_pickle_by_value(mod)
    return mod


def test_the_lecture_plan_is_megatrons_cut():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    tp = lecture_tp()
    plain, sp = tp.block_plan(), tp.block_plan(sp=True)
    for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.fc"):
        assert type(plain[name]) is ColwiseParallel and type(sp[name]) is ColwiseParallel
    for name in ("attn.wo", "mlp.out"):
        assert type(plain[name]) is RowwiseParallel
        assert plain[name].output_layouts == (Replicate(),) and sp[name].output_layouts == (Shard(1),)
    assert "ln1" not in plain and type(sp["ln1"]) is SequenceParallel and type(sp["ln2"]) is SequenceParallel
    assert plain["attn"].input_layouts == (Replicate(),) and sp["mlp"].input_layouts == (Shard(1),)


def test_tp_step_peak_within_5_percent():
    from distlab.course.tensor_parallel.measure import tp_model_run
    from distlab.course.tensor_parallel.model import TP_PRESETS
    parallelize = lecture_tp().parallelize
    cfg, b, t = TP_PRESETS["tp-small"], 4, 2
    h, a, s, n_layers, v = cfg.d_model, cfg.n_heads, cfg.seq_len, cfg.n_layers, cfg.vocab_size
    act = n_layers * th.activation_bytes_per_layer(s, b, h, a, t=t, bytes_per_element=4, dropout=False,
                                                   layernorm_stats=True)
    peak = th.lm_train_peak_bytes(b, s, h, a, n_layers, v, t, buffer_bytes=n_layers * s * s)
    # A second launch only when the first read one extra storage: full suites on the loaded CI machine
    # booked 32 KiB more than the model, once in the activations and once in the step's peak (1,641,264 B
    # for 1,608,224: one b*s*h fp32 activation and 272 B of scalars), gloo's worker still holding a dropped
    # temporary past the meter's grace (see meters.memory GRACE_S). An exact miss twice in a row still fails.
    for attempt in range(2):
        run = distlab.launch(tp_model_run, t, args=(parallelize, "tp-small", b, 2, 1, 1))[0]
        if run["act"] == act and run["peak"] / peak == pytest.approx(1, abs=0.001):
            break
    assert run["peak"] / peak == pytest.approx(1, abs=0.05)
    assert run["peak"] / peak == pytest.approx(1, abs=0.001)          # on CPU ranks, all but a few scalars
    assert run["act"] == act
    assert run["state"].params == th.lm_params_per_rank(h, n_layers, v, s, t) * 4 + n_layers * s * s


def test_ring_attention_keeps_its_output_and_lse_only():
    from distlab.course.tensor_parallel.measure_cp import cp_run
    ring = lecture_ring()
    b, heads, seq, hd, cp = 1, 4, 48, 8, 3      # cp = 3: a middle rank merges with a block still in flight
    out = distlab.launch(cp_run, cp, args=({"ring": ring.ring_attention}, b, heads, seq, hd, 1, 1, ring.RingAttention.apply))
    for r, o in enumerate(out):
        # the forward's peak (the cp_ring record's peak_bytes), rank by rank: the previous block's output included
        assert o["ring"]["peak"] == th.ring_attention_forward_peak_bytes(b, heads, seq, hd, cp, rank=r,
                                                                         bytes_per_element=4)
        tr = o["train"]
        assert tr["kept"] == th.ring_attention_activation_bytes(b, heads, seq, hd, cp, bytes_per_element=4)
        assert tr["one_kept"] == th.attention_activation_bytes(b, heads, seq, hd, bytes_per_element=4)
        assert tr["fwd"].bytes["send"] == th.ring_attention_bytes(b, seq, heads * hd, cp, bytes_per_element=4)
        assert tr["bwd"].bytes["send"] == th.ring_attention_backward_bytes(b, seq, heads * hd, cp, bytes_per_element=4)
        assert max(tr[k] for k in ("delta", "dq", "dk", "dv")) < 1e-5
