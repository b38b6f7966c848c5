"""The layout planner: which (dp, tp, pp, cp, ZeRO stage, micro-batches) to train a model with.

    spec = ModelSpec.from_size(70e9)                            # a GPT-shaped 70B model
    plans = candidates(spec, Workload(seq_len=4096, global_batch=1024), Cluster(gpus=256))
    print(markdown(plans[:5]))                                  # ranked: fits, then estimated step time
    planner()                                                   # the same as a widget in Jupyter

Every prediction is a closed form over the model's shape (`ModelSpec`): model
states per device by pipeline stage (the first stage holds the embeddings, the
last the head), activations by schedule, bytes each device sends per step in
each group (dp, tp, pp, cp) and on which link (NVLink inside a node, InfiniBand
between nodes, by the course's one mesh order, outermost first (pp, dp, cp, tp):
tp innermost, then cp, then dp, pp outermost — the heaviest, latency-critical
traffic on neighbouring ranks of one node, the lightest (pp's point-to-point
activations) on the groups that span nodes), and the bubble. `plan(...)` is one layout; `candidates(...)`
enumerates and ranks them. Pure functions: chapter 8 checks them against the
layouts it measures on CPU ranks.

Assumptions, stated once: Megatron-style tensor parallelism (2 all-reduces of
the activation in each block's forward, 2 in its backward, LayerNorms and
row-parallel biases replicated), vocabulary-parallel embedding and head when
`vocab_parallel` (replicated otherwise, as in the chapter's own 3-D code), 1F1B
(or GPipe) schedules, ZeRO over dp, mixed-precision Adam (2 + 2 + 12 bytes per
parameter) unless told otherwise, activations per layer as in Korthikanti et
al. (2022) with sequence parallelism: s b h (34 + 5 a s / h) / tp bytes, without the
attention-score term 5as/h under FlashAttention (the default).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from distlab.theory.hardware import A100, H100, GPU
from distlab.theory.pipeline import activations_in_flight, bubble_fraction, dp_bytes

GB = 1e9

# The seeds' recipe table by model size (2025): the reference the planner's choices are read against.
RECIPES = (
    (0, 10e9, "data parallel with ZeRO-1/2"),
    (10e9, 70e9, "ZeRO-3 (FSDP or DeepSpeed)"),
    (70e9, 175e9, "ZeRO-3 + tensor parallel (8+ GPUs)"),
    (175e9, float("inf"), "3-D parallelism: dp x tp x pp (+ ZeRO on dp)"),
)
LAPTOP_RECIPE = "ZeRO-Offload (slow, but it trains)"

# GPT shapes used when only a size is given: (layers, d_model, heads).
_SHAPES = ((1.3e9, 24, 2048, 16), (7e9, 32, 4096, 32), (13e9, 40, 5120, 40), (34e9, 48, 7168, 56),
           (70e9, 80, 8192, 64), (175e9, 96, 12288, 96), (405e9, 126, 16384, 128), (1e12, 128, 25600, 160))


def recipe(num_params: float, *, gpus: int = 8) -> str:
    """The seeds' rule of thumb for a model of `num_params` parameters."""
    if gpus <= 1:
        return LAPTOP_RECIPE
    return next(text for lo, hi, text in RECIPES if lo <= num_params < hi)


@dataclass(frozen=True)
class ModelSpec:
    """A GPT: `n_layers` blocks of width `d_model`, embeddings and an untied head."""

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int = 50_304
    max_seq: int = 4096             # learned position embeddings (0: none, e.g. RoPE)
    name: str = ""

    @classmethod
    def from_config(cls, config: Any, name: str = "") -> "ModelSpec":
        """From a `distlab.course.models.GPTConfig`: exactly the course model's parameter count."""
        return cls(config.n_layers, config.d_model, config.n_heads, config.vocab_size, config.seq_len, name)

    @classmethod
    def from_size(cls, num_params: float, vocab_size: int = 128_256) -> "ModelSpec":
        """A GPT shape of about `num_params` parameters (the nearest common shape, depth rescaled)."""
        _, layers, d, heads = min(_SHAPES, key=lambda s: abs(math.log(s[0] / num_params)))
        per_layer = 12 * d * d + 13 * d
        layers = max(1, round((num_params - 2 * vocab_size * d) / per_layer))
        return cls(layers, d, heads, vocab_size, 0, f"{num_params / 1e9:g}B")

    @property
    def layer_params(self) -> int:
        d = self.d_model
        return 12 * d * d + 13 * d   # qkv 3d²+3d, proj d²+d, fc 4d²+4d, out 4d²+d, two LayerNorms 4d

    @property
    def num_params(self) -> int:
        d = self.d_model
        return self.n_layers * self.layer_params + self.vocab_size * d + self.max_seq * d + 2 * d + self.vocab_size * d


@dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch: int               # sequences per optimizer step


@dataclass(frozen=True)
class Cluster:
    """GPUs and what a training process cannot use of their memory.

    Headroom (defaults, typical orders of magnitude, not measured here): the CUDA context and
    kernels' workspaces (~0.5 GB per process), NCCL's buffers (NCCL_BUFFSIZE, 4 MiB by default, per
    channel and peer, for each communicator: dp, tp, pp, cp; ~1 GB), and the caching allocator's
    fragmentation (a share of the rest that free blocks of the wrong size waste). `mfu`: the share
    of peak bf16 FLOP/s the step's matmuls reach while nothing else waits — the kernels' efficiency,
    an assumed input (it falls with smaller matrices per GPU, i.e. with tp and small micro-batches);
    vary it to see which rankings it changes. The MFU each plan reaches is an output (`Plan.mfu`):
    below this by the bubble, the exposed communication and recomputation's extra forward.
    """

    gpus: int
    gpu: GPU = H100
    memory_GB: float | None = None  # default: the GPU's
    mfu: float = 0.4                # share of peak bf16 FLOP/s the matmuls reach, nothing waiting (assumed)
    context_GB: float = 0.5         # CUDA context, cuBLAS/cuDNN workspaces
    nccl_GB: float = 1.0            # NCCL's communication buffers, all communicators
    fragmentation: float = 0.05     # share of the remaining memory lost to the allocator's fragmentation

    @property
    def memory_bytes(self) -> float:
        return (self.memory_GB or self.gpu.memory_GB) * GB

    @property
    def usable_bytes(self) -> float:
        """What the model's states, activations and buffers may fill: memory less the headroom."""
        return max(0.0, self.memory_bytes - (self.context_GB + self.nccl_GB) * GB) * (1 - self.fragmentation)


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 1
    micro_batch: int = 1
    m: int = 1                      # micro-batches per step (per pipeline)
    schedule: str = "1f1b"
    recompute: bool = False

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self) -> str:
        extra = ", recompute" if self.recompute else ""
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp} ZeRO-{self.zero} "
                f"mb={self.micro_batch} m={self.m}{extra}")


@dataclass(frozen=True)
class Plan:
    layout: Layout
    params_local: list[int]                       # per pipeline stage, on one device
    model_state_bytes: list[float]                # per stage: params + grads + optimizer
    activation_bytes: list[float]                 # per stage, at the schedule's peak
    traffic: dict[str, list[float]]               # group -> per stage, bytes one device sends per step
    links: dict[str, str] = field(default_factory=dict)   # group -> "nvlink" or "ib"
    bubble: float = 0.0
    step_s: float = 0.0
    fits: bool = True
    buffers: dict[str, list[float]] = field(default_factory=dict)   # per stage: logits, gathered units, fp32 grads
    mfu: float = 0.0                              # model FLOPs (6 Psi per token) / (devices x peak x step_s)

    @property
    def buffer_bytes(self) -> list[float]:
        """Per stage: the buffers beside model states and block activations (sum of `buffers`)."""
        return [sum(v[r] for v in self.buffers.values()) for r in range(len(self.model_state_bytes))]

    @property
    def memory_bytes(self) -> float:
        """The busiest device: model states + activations + buffers, maximised over stages."""
        extra = self.buffer_bytes
        return max(s + a + e for s, a, e in zip(self.model_state_bytes, self.activation_bytes, extra))

    @property
    def frameworks(self) -> str:
        """Which frameworks can run this layout as it is (2025)."""
        return frameworks(self.layout)

    def link_bytes(self) -> dict[str, float]:
        """Bytes one device of the busiest stage sends per step on each kind of link."""
        out = {"nvlink": 0.0, "ib": 0.0}
        for group, per_stage in self.traffic.items():
            out[self.links.get(group, "nvlink")] += max(per_stage)
        return out


def local_params(spec: ModelSpec, tp: int, pp: int, stage: int, *, vocab_parallel: bool = True) -> int:
    """Parameters one device of pipeline stage `stage` holds with tensor parallelism `tp`."""
    from distlab.course.pipeline.stages import stage_layers
    d = spec.d_model
    a, b = stage_layers(spec.n_layers, pp)[stage]
    # Column-parallel qkv and fc (weights and biases split), row-parallel proj and out (weights
    # split, biases replicated), LayerNorms replicated.
    block = (12 * d * d + 7 * d) // tp + 6 * d
    n = (b - a) * block
    vocab = spec.vocab_size * d // (tp if vocab_parallel else 1)
    if stage == 0:
        n += vocab + spec.max_seq * d
    if stage == pp - 1:
        n += vocab + 2 * d
    return n


def _model_states(n: int, dp: int, zero: int, param_bytes: float, grad_bytes: float, k: float) -> float:
    shard = math.ceil(n / dp)
    return {0: (param_bytes + grad_bytes + k) * n, 1: (param_bytes + grad_bytes) * n + k * shard,
            2: param_bytes * n + (grad_bytes + k) * shard, 3: (param_bytes + grad_bytes + k) * shard}[zero]


def _activation_per_layer(spec: ModelSpec, layout: Layout, seq_len: int, act_bytes: float,
                          flash_attention: bool) -> float:
    s, b, h, a = seq_len / layout.cp, layout.micro_batch, spec.d_model, spec.n_heads
    if layout.recompute:
        return s * b * h * act_bytes / layout.tp                   # only each block's input is kept
    scores = 0.0 if flash_attention else 2.5 * act_bytes * a * s / h   # the s x s attention matrices
    return s * b * h * (17 * act_bytes + scores) / layout.tp       # 34 + 5as/h bytes at 2-byte activations


def _links(layout: Layout, gpus_per_node: int) -> dict[str, str]:
    """Rank order tp (innermost), cp, dp, pp: a group stays in a node when its span fits."""
    out, stride = {}, 1
    for group in ("tp", "cp", "dp", "pp"):
        size = getattr(layout, group)
        out[group] = "nvlink" if size * stride <= gpus_per_node else "ib"
        stride *= size
    return out


def plan(spec: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster | None = None, *,
         param_bytes: float = 2, grad_bytes: float = 2, k: float = 12, act_bytes: float = 2,
         vocab_parallel: bool = True, flash_attention: bool = True, accum_bytes: float = 4) -> Plan:
    """Predictions for one layout (per pipeline stage, for one device of that stage).

    `act_bytes`: bytes per activation element (2 for bf16). `flash_attention`: the
    attention scores are never stored (FlashAttention), dropping Korthikanti's 5as/h term.
    `accum_bytes`: bytes per element of the buffer gradients accumulate in over m micro-batches
    (4: fp32, as Megatron's main gradients and DeepSpeed's bf16 accumulation; 2 accumulates in the
    16-bit gradient itself, as the chapter's own ZeRO-1 does).

    Besides model states and block activations, `buffers` holds per stage: "logits" (the last
    stage's (b, s, V) logits in 16 bits, their fp32 upcast and gradient for one micro-batch, and the
    fp32 softmax saved for each micro-batch in flight), "gathered" (ZeRO-3: the all-gathered unit in
    use and the next one prefetched, 2 x the largest unit), "fp32 grads" (accumulation beyond the
    16-bit gradient). Traffic is algorithmic bytes: each call's size through the ring formula.
    """
    L = layout
    if L.pp > spec.n_layers:
        raise ValueError(f"{L.pp} pipeline stages for {spec.n_layers} layers")
    if spec.n_heads % L.tp:
        raise ValueError(f"tp={L.tp} does not divide the {spec.n_heads} heads")
    stages = range(L.pp)
    n_local = [local_params(spec, L.tp, L.pp, r, vocab_parallel=vocab_parallel) for r in stages]
    states = [_model_states(n, L.dp, L.zero, param_bytes, grad_bytes, k) for n in n_local]
    per_layer = _activation_per_layer(spec, L, workload.seq_len, act_bytes, flash_attention)
    from distlab.course.pipeline.stages import stage_layers
    layers = [b - a for a, b in stage_layers(spec.n_layers, L.pp)]
    acts = [activations_in_flight(L.schedule, L.pp, L.m, r) * layers[r] * per_layer for r in stages]
    elems = L.micro_batch * (workload.seq_len / L.cp) * spec.d_model      # one activation b s h
    tokens_mb = L.micro_batch * workload.seq_len / L.cp                  # b s of one micro-batch
    ring = 2 * (L.tp - 1) / L.tp
    vp = vocab_parallel and L.tp > 1

    def tp_calls(r: int) -> float:
        """Bytes of one micro-batch's tp all-reduces on stage r (each call's size)."""
        calls = 4 * layers[r] * elems * act_bytes                       # f and g around attention and MLP
        if vp and r == 0:
            calls += elems * act_bytes                                  # the vocabulary-parallel embedding's g
        if vp and r == L.pp - 1:
            calls += elems * act_bytes                                  # the head's f: its input gradient, backward
            calls += 3 * tokens_mb * 4                                  # cross-entropy: max, sum of exp, target logit (fp32)
        return calls

    traffic = {
        "dp": [dp_bytes(n, L.dp * L.cp, L.zero, grad_bytes, L.m) for n in n_local],   # cp shares dp's gradients
        "tp": [L.m * tp_calls(r) * ring for r in stages],
        "pp": [L.m * ((r < L.pp - 1) + (r > 0)) * elems * act_bytes for r in stages],
        # Ring attention passes K and V around the cp ring: forward once, backward twice.
        "cp": [L.m * layers[r] * 3 * 2 * elems * act_bytes * (L.cp - 1) / L.tp for r in stages],
    }
    vocab_local = spec.vocab_size / (L.tp if vp else 1)
    last = L.pp - 1
    logits = [0.0] * L.pp
    logits[last] = tokens_mb * vocab_local * ((act_bytes + 4 + 4) + 4 * (activations_in_flight(L.schedule, L.pp, L.m, last) - 1))
    d = spec.d_model
    unit = max((12 * d * d + 7 * d) // L.tp + 6 * d, spec.vocab_size * d // (L.tp if vocab_parallel else 1))
    gathered = [2 * unit * param_bytes if L.zero == 3 else 0.0 for _ in stages]
    accum = [(accum_bytes - grad_bytes) * (n if L.zero < 2 else math.ceil(n / L.dp)) if L.m > 1 else 0.0
             for n in n_local]
    buffers = {"logits": logits, "gathered": gathered, "fp32 grads": [max(0.0, a) for a in accum]}
    c = cluster or Cluster(gpus=L.gpus)
    links = _links(L, c.gpu.gpus_per_node)
    bub = bubble_fraction(L.pp, L.m) if L.pp > 1 else 0.0
    tokens = workload.global_batch * workload.seq_len
    flops = 6 * spec.num_params * tokens * (4 / 3 if L.recompute else 1)
    compute = flops / (L.gpus * c.gpu.bf16_TFLOPs * 1e12 * c.mfu)
    bw = {"nvlink": c.gpu.nvlink_GBps * 1e9, "ib": c.gpu.ib_GBps * 1e9}
    exposed = sum(max(traffic[g]) / bw[links[g]] for g in ("tp", "pp", "cp"))
    hidden_dp = max(traffic["dp"]) / bw[links["dp"]] - compute * 2 / 3       # overlaps the backward
    step = compute / (1 - bub) + exposed + max(0.0, hidden_dp)
    # What the step reaches, counted as MFU is (the model's 6 Psi FLOPs per token, recomputation not
    # counted): the kernels' efficiency less the bubble, the exposed communication and the recomputation.
    mfu = 6 * spec.num_params * tokens / (L.gpus * c.gpu.bf16_TFLOPs * 1e12 * step)
    p = Plan(L, n_local, states, acts, traffic, links, bub, step, buffers=buffers, mfu=mfu)
    return replace(p, fits=p.memory_bytes <= c.usable_bytes)


def frameworks(layout: Layout) -> str:
    """Frameworks that offer `layout` as such (2025). ZeRO-2/3 with a pipeline is not offered by
    DeepSpeed's pipeline engine (ZeRO-1 only) nor by Megatron-LM (its distributed optimizer is
    ZeRO-1); torchtitan composes FSDP2 (ZeRO-3, or ZeRO-2 with reshard_after_forward=False) with
    `torch.distributed.pipelining`."""
    L = layout
    if L.pp > 1:
        if L.zero >= 2:
            return "torchtitan (FSDP2 + pipelining) only"
        return "Megatron-LM, DeepSpeed pipeline engine, torchtitan"
    if L.tp > 1 or L.cp > 1:
        return "Megatron-LM, torchtitan" + (", DeepSpeed (with Megatron's tp)" if L.cp == 1 else "")
    return "DeepSpeed ZeRO, FSDP2 / torchtitan" + (", Megatron-LM" if L.zero <= 1 else "")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(spec: ModelSpec, workload: Workload, cluster: Cluster, *, zero_stages: tuple[int, ...] = (1, 2, 3),
               micro_batches: tuple[int, ...] = (1, 2, 4), cp_sizes: tuple[int, ...] = (1, 2, 4),
               recompute: tuple[bool, ...] = (False, True), **kw: Any) -> list[Plan]:
    """Every valid layout of `cluster.gpus` devices, ranked: layouts that fit first, then by estimated
    step time, then by bytes sent.

    Valid: tp divides the heads and stays in a node; pp <= layers; dp x m x micro_batch = the
    global batch (pipelines spend batch: m >= pp; without a pipeline the m micro-batches are
    accumulated one after the other); cp only for sequences of 8k tokens or more.
    """
    out = []
    for tp in [t for t in _divisors(cluster.gpus) if t <= cluster.gpu.gpus_per_node and spec.n_heads % t == 0]:
        for cp in [c for c in cp_sizes if c == 1 or workload.seq_len >= 8192]:
            if (cluster.gpus // tp) % cp:
                continue
            for pp in [p for p in _divisors(cluster.gpus // (tp * cp)) if p <= spec.n_layers]:
                dp = cluster.gpus // (tp * cp * pp)
                for mb in micro_batches:
                    if workload.global_batch % (dp * mb):
                        continue
                    m = workload.global_batch // (dp * mb)
                    if pp > 1 and m < pp:
                        continue          # a pipeline needs m >= pp micro-batches: it spends batch
                    for zero in zero_stages if dp > 1 else (0,):
                        for rc in recompute:
                            layout = Layout(dp, tp, pp, cp, zero, mb, m, "1f1b", rc)
                            out.append(plan(spec, layout, workload, cluster, **kw))
    # Ties in step time (dp traffic hidden under the backward) go to the layout that moves fewer bytes.
    return sorted(out, key=lambda p: (not p.fits, round(p.step_s, 3), sum(p.link_bytes().values()),
                                      p.memory_bytes))


def markdown(plans: list[Plan], cluster: Cluster | None = None) -> str:
    """A ranked table: memory per device, bytes per device per step by link, bubble, estimated step,
    and the frameworks that run the layout. The byte columns are algorithmic bytes (each call's
    size through the ring formula), not what a profiler would see on the wire."""
    lines = ["| # | layout | GB per device | fits | NVLink GB/step | IB GB/step | bubble | step (s, est.) | MFU (est.) | runs on |",
             "|---:|---|---:|:-:|---:|---:|---:|---:|---:|---|"]
    for i, p in enumerate(plans, 1):
        lb = p.link_bytes()
        lines.append(f"| {i} | {p.layout} | {p.memory_bytes / GB:.1f} | {'yes' if p.fits else 'no'} | "
                     f"{lb['nvlink'] / GB:.2f} | {lb['ib'] / GB:.2f} | {p.bubble:.2f} | {p.step_s:.2f} | "
                     f"{p.mfu:.0%} | {p.frameworks} |")
    lines.append("")
    lines.append("GB per device: model states + activations + logits, ZeRO-3's gathered units and fp32 gradient "
                 "accumulation, against the memory less headroom (CUDA context, NCCL buffers, fragmentation). "
                 "NVLink / IB: algorithmic bytes (each call's size through the ring formula) one device sends per step. "
                 "MFU (est.): the model's 6 Psi FLOPs per token over the devices' peak and the estimated step: the "
                 "kernels' assumed efficiency less the bubble, exposed communication and recomputation.")
    lines.append("Model states per device are checked against simulation (`distlab.course.sim.check_recipes`: the "
                 "recipes 7B ZeRO-2 on 8, 13B ZeRO-3 on 16, 70B ZeRO-3 + TP 8 on 64 and 175B dp 8 x tp 8 x pp 16 + "
                 "ZeRO-3 on 1024, each run as rank 0 of its GPUs on fake tensors): within 5 % (tests/test_sim.py). "
                 "Activations and the step time are the model's alone.")
    return "\n".join(lines)


GPUS = {"H100 (NVLink 4, NDR IB)": H100, "A100 (NVLink 3, HDR IB)": A100}


def planner(num_params: float = 70e9, gpus: int = 256, *, seq_len: int = 4096, global_batch: int = 1024,
            top: int = 8) -> Any:
    """Sliders for model size, sequence, batch, GPU kind, memory and count -> the ranked layouts.

    Returns the ipywidgets container (its first drawing happens at once, so a static run
    records a widget view and no error).
    """
    import ipywidgets as w
    from IPython.display import Markdown, display

    size = w.FloatLogSlider(value=num_params, base=10, min=8, max=12.3, step=0.05, description="params Ψ",
                            readout_format=".3g")
    n = w.IntSlider(value=gpus, min=8, max=4096, step=8, description="GPUs")
    seq = w.Dropdown(options=[1024, 2048, 4096, 8192, 16384, 32768], value=seq_len, description="sequence")
    batch = w.IntSlider(value=global_batch, min=8, max=8192, step=8, description="global batch")
    kind = w.Dropdown(options=list(GPUS), value=next(iter(GPUS)), description="GPU")
    mem = w.FloatSlider(value=80, min=16, max=192, step=8, description="GPU GB")
    out = w.Output()

    def redraw(*_: Any) -> None:
        spec = ModelSpec.from_size(size.value)
        cluster = Cluster(n.value, GPUS[kind.value], mem.value)
        plans = candidates(spec, Workload(seq.value, batch.value), cluster)
        out.clear_output(wait=True)
        with out:
            head = (f"**{spec.num_params / 1e9:.1f}B parameters** ({spec.n_layers} layers, d = {spec.d_model}) "
                    f"on {n.value} x {cluster.gpu.name}, {mem.value:g} GB each. "
                    f"Seeds' recipe: *{recipe(spec.num_params, gpus=n.value)}*.")
            if not plans:
                display(Markdown(head + "\n\nNo layout: the global batch does not split over these GPUs."))
                return
            display(Markdown(head + "\n\n" + markdown(plans[:top])))

    for control in (size, n, seq, batch, kind, mem):
        control.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([size, n]), w.HBox([seq, batch]), w.HBox([kind, mem]), out])
