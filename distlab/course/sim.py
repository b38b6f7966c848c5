"""Scale by simulation: one training step of a strategy's real code, as rank 0 of N, on fake tensors.

    from distlab.course.sim import simulate, scale_config
    res = simulate("zero3", num_params=7.5e9, world_size=64, classes={"ZeRO3": ZeRO3})
    res.model_state.total / 1e9     # 1.875 GB: 16 Psi / N, measured from the learner's own ZeRO3
    res.comm.bytes                  # {'broadcast': ..., 'all_gather': ..., 'reduce_scatter': ...}
    check_recipes(classes)          # chapter 8's planner against simulation: 7B, 13B, 70B, 175B

One process plays rank 0 of a world of N under PyTorch's `fake` process-group
backend (`FakeStore`: every collective returns at once, nothing is sent) while
`FakeTensorMode` gives every tensor a shape, a dtype and a device but no
storage. The strategy's code runs unchanged: the learner's `ShardedOptimizer`,
`ZeRO2` and `ZeRO3` classes, PyTorch's `DistributedDataParallel` and FSDP2's
`fully_shard`. The meters the small runs use (`track_memory`, `model_state`,
`track_comm`) book it, so the bytes are booked exactly as a real gloo run
books them: at small N the two agree to the byte (tests/test_sim.py).

One difference is made on purpose: a fake storage has no address
(`data_ptr()` is 0), while the meters and the ZeRO-3 lab key storages by
their address. During a simulation each fake storage reports a distinct
address instead (its C++ storage object's), which keeps the bookkeeping the
same as on real memory.

What a fake run cannot tell: time (nothing is computed or sent), the real
allocator's rounding and fragmentation, and memory that is not a tensor the
dispatcher sees (NCCL's buffers, the CUDA context, cuBLAS workspaces).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.course.data_parallel.measure import Strategy
from distlab.course.models import GPTConfig, num_params as count_params, split_batch, synthetic_batch
from distlab.engine.precision import MixedPrecisionAdam
from distlab.meters import CommStats, ModelState, model_state, track_comm, track_memory
from distlab.theory import comm_bytes_per_rank, zero_memory_per_device

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}
# The lab class each strategy needs from the learner (or the shipped solution).
LAB_CLASS = {"zero1": ("03_zero1", "ShardedOptimizer"), "zero2": ("04_zero2", "ZeRO2"),
             "zero3": ("05_zero3", "ZeRO3")}
LR = 1e-3

# Shapes of the source notes' models by size (hidden h, layers L, heads), GPT-3 / Llama-like.
_SHAPES = ((1.5e9, 2048, 24, 16), (4e9, 3072, 32, 24), (1e10, 4096, 36, 32), (2e10, 5120, 40, 40),
           (4e10, 6656, 60, 52), (1e11, 8192, 80, 64), (float("inf"), 12288, 96, 96))


def scale_config(num_params: float, *, seq_len: int = 2048, d_model: int | None = None,
                 n_layers: int | None = None, n_heads: int | None = None) -> GPTConfig:
    """A course GPT with about `num_params` parameters: a known shape for its size (7.5B: h = 4096,
    36 layers, 32 heads, the calculator's), and the vocabulary that makes up the rest.

    Ψ = L (12 h² + 13 h) + (2 V + S + 2) h  (blocks, token embedding and head, positions, final norm).
    """
    shape = next(s for s in _SHAPES if num_params <= s[0])
    h, layers, heads = d_model or shape[1], n_layers or shape[2], n_heads or shape[3]
    per_layer = 12 * h * h + 13 * h
    rest = num_params - (seq_len + 2) * h
    layers = min(layers, max(1, int(rest // per_layer)))   # small targets: fewer layers
    vocab = max(64, round((rest - layers * per_layer) / (2 * h)))
    return GPTConfig(vocab_size=vocab, seq_len=seq_len, d_model=h, n_layers=layers, n_heads=heads)


# ---- the fake world -------------------------------------------------------------------------------------

@contextmanager
def _fake_addresses() -> Iterator[None]:
    """A fake (meta) storage reports its C++ object's address as `data_ptr()` (distinct while it lives),
    so that storages keyed by address stay apart, as on real memory."""
    original = torch.UntypedStorage.data_ptr

    def data_ptr(storage: torch.UntypedStorage) -> int:
        return storage._cdata if storage.device.type == "meta" else original(storage)

    torch.UntypedStorage.data_ptr = data_ptr  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.data_ptr = original  # type: ignore[method-assign]


@contextmanager
def _fake_resizes_booked() -> Iterator[None]:
    """FSDP2 frees and re-allocates gathered weights with `untyped_storage().resize_()`, which
    `track_memory` books for CPU storages; a fake storage lives on `meta`, so its resizes are handed
    to the active trackers here, in the same way."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from distlab.meters import memory
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        old_key, old_bytes = storage.data_ptr(), storage.nbytes()
        out = original(storage, size)
        if storage.device.type == "meta":
            for mode in _get_current_dispatch_mode_stack():
                if isinstance(mode, memory._StorageTracker):
                    mode.on_resize(old_key, old_bytes, storage)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


@contextmanager
def _tracker_on_fake_tensors() -> Iterator[None]:
    """Two ops `track_memory` sees only on fake tensors, passed through unbooked:

    - `aten.lift_fresh`: a tensor made from Python data (`torch.tensor(0.0)`, AdamW's step counter) is
      born outside the dispatcher on a real CPU, so the tracker never books it; a fake run lifts it into
      a fake tensor through the dispatcher. Unbooked, as on real memory.
    - `prim.device`: asking a fake tensor its device is itself an op (half of all ops in a simulation);
      it allocates nothing.
    """
    from distlab.meters import memory
    original = memory._StorageTracker.__torch_dispatch__
    passed = (torch.ops.aten.lift_fresh.default, torch.ops.prim.device.default)

    def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in passed:
            return func(*args, **(kwargs or {}))
        return original(self, func, types, args, kwargs)

    memory._StorageTracker.__torch_dispatch__ = dispatch  # type: ignore[method-assign]
    try:
        yield
    finally:
        memory._StorageTracker.__torch_dispatch__ = original  # type: ignore[method-assign]


@contextmanager
def _ddp_on_fake_backend() -> Iterator[None]:
    """Two things DDP's C++ side needs from real tensors and a real backend: its construction compares
    parameter shapes across ranks by reading tensor data (skipped: one process plays every rank), and
    its default gradient hook takes the all-reduced bucket from the Work's future, which the fake
    backend leaves empty (`fake_ddp_hook` does the same all-reduce and hands the bucket back)."""
    import torch.nn.parallel.distributed as ddp_module
    original = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = original


def fake_ddp_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default gradient hook, as PyTorch writes it in C++ (the bucket divided by N, then one
    all_reduce of it, in place), returning the bucket through a completed future."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    dist.all_reduce(buf)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP checks a hook's annotations as objects (this module's are strings: `from __future__ import annotations`).
fake_ddp_hook.__annotations__.update(bucket=dist.GradBucket, state=object, **{"return": torch.futures.Future[torch.Tensor]})


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[Any]:
    """Inside the block this process is rank `rank` of `world_size` (fake backend) and every new
    tensor is a fake one. Yields the FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world_size {world_size}: need world_size >= 1 and 0 <= rank < world_size")
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process: a simulation starts its own "
                           "fake one. Run it outside distlab.launch's ranks (in the notebook's kernel).")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with (FakeTensorMode() as mode, _fake_addresses(), _fake_resizes_booked(), _tracker_on_fake_tensors(),
              _ddp_on_fake_backend()):
            yield mode
    finally:
        dist.destroy_process_group()


def _mesh() -> Any:
    """`distlab.mesh()`; in a simulation built from real tensors (a DeviceMesh reads its rank map)."""
    from distlab.engine.runtime import mesh
    if dist.get_backend() != "fake":
        return mesh()
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        return mesh()


# ---- the strategies, as the chapters build them -------------------------------------------------------------

@dataclass
class Built:
    """A strategy ready to train, and what holds its model states on this rank."""

    strategy: Strategy
    params: Any        # what holds the parameters (the model, or ZeRO-3's shards)
    grads: Any = None  # what holds the gradients, when not the parameters' .grad (ZeRO-2's shards)


def build(name: str, model: nn.Module, classes: dict[str, Any] | None = None, *,
          bucket_size_mb: float = 25.0) -> Built:
    """Wrap a bf16 `model` as chapter 2-6 do: DDP and ZeRO-1/2 with `MixedPrecisionAdam` (K = 12),
    ZeRO-3 with fp32 AdamW on its fp32 shards, FSDP2 (`fully_shard` per block) with `MixedPrecisionAdam`
    on the DTensor shards. `classes` maps the lab class names (ShardedOptimizer, ZeRO2, ZeRO3) to the
    learner's classes."""
    classes = classes or {}
    if name in LAB_CLASS and LAB_CLASS[name][1] not in classes:
        lab, cls = LAB_CLASS[name]
        raise ValueError(f"strategy {name!r} runs your {cls} class from lab {lab}: pass classes={{'{cls}': {cls}}}")
    if name == "ddp":
        from distlab.course.data_parallel.ddp import TorchDDP
        ddp = TorchDDP(model, bucket_cap_mb=bucket_size_mb, gradient_as_bucket_view=True)
        if dist.get_backend() == "fake":
            ddp.register_comm_hook(None, fake_ddp_hook)
        return Built(Strategy(ddp, MixedPrecisionAdam(model.parameters(), lr=LR)), model)
    if name == "zero1":
        opt = classes["ShardedOptimizer"](model.parameters(), MixedPrecisionAdam, lr=LR)
        return Built(Strategy(model, opt), model)
    if name == "zero2":
        opt = classes["ZeRO2"](model.parameters(), MixedPrecisionAdam, bucket_size_mb=bucket_size_mb, lr=LR)
        return Built(Strategy(model, opt, state_of=opt.optim), model, grads=[b.grad_shard for b in opt.buckets])
    if name == "zero3":
        z = classes["ZeRO3"](model, optimizer=lambda shards: torch.optim.AdamW(shards, lr=LR),
                             gather_dtype=torch.bfloat16)
        return Built(Strategy(z, z.optimizer), z.shards())
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        m = _mesh()
        for block in model.blocks:
            fully_shard(block, mesh=m)
        fully_shard(model, mesh=m)
        return Built(Strategy(model, MixedPrecisionAdam(model.parameters(), lr=LR)), model)
    raise ValueError(f"unknown strategy {name!r}; choose one of {STRATEGIES}")


def bf16_model(config: GPTConfig, seed: int = 0) -> nn.Module:
    """The course GPT born in bf16 (no fp32 copy first), on the rank's device; in a simulation on the
    fake CPU as it is born (`Module.to` cannot move fake parameters, and has nowhere to move them)."""
    from distlab.course.models import GPT
    from distlab.engine.runtime import device
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = GPT(config)
    finally:
        torch.set_default_dtype(default)
    return model if dist.is_initialized() and dist.get_backend() == "fake" else model.to(device())


# ---- one step, measured (the same function on real ranks and in a simulation) ---------------------------------

@dataclass(frozen=True)
class StepBytes:
    """What one rank measured over a training step (bytes).

    model_state: params / grads / optimizer state alive at the step boundary (after step(), before zero_grad);
    peak_bytes: the most bytes alive during the measured step (model states, activations, gathered units,
      buckets and temporaries included); comm: calls and algorithmic bytes sent per collective in that step.
    """

    model_state: ModelState
    peak_bytes: int
    comm: CommStats
    num_params: int


def measure_step(name: str, config: GPTConfig, classes: dict[str, Any] | None = None, *,
                 batch_size: int, bucket_size_mb: float = 25.0, steps: int | None = None) -> StepBytes:
    """On every rank (real or fake): build the bf16 course model and `name`, train on the rank's slice
    of a `batch_size`-row batch; the figures of the last of `steps` steps (default 2: the first creates
    the optimizer states; with steps=1 the model states at its end are the same, and its peak includes
    their birth).

    DDP is measured on its first step: before its second forward it re-orders its buckets by the order
    gradients arrived, agreeing on it across ranks by reading a broadcast tensor's data, which a fake
    run does not have. Its optimizer states are born inside that step (they are alive at its end).
    """
    steps = 1 if name == "ddp" else (steps or 2)
    from distlab.engine import runtime as rt
    fake = dist.get_backend() == "fake"
    with track_memory("cpu" if fake else None) as mem:
        model = bf16_model(config)
        psi = count_params(model)
        built = build(name, model, classes, bucket_size_mb=bucket_size_mb)
        s = built.strategy
        for step in range(steps):
            x, y = split_batch(synthetic_batch(step, batch_size, config, device="cpu" if fake else None),
                               rt.rank(), rt.world_size())
            if step == steps - 1:
                mem.reset_peak()
            with track_comm() as comm:
                s.step(x, y)
            if step == steps - 1:
                state = model_state(built.params, grads=built.grads, optimizer=s.state_of or s.optimizer)
                peak = mem.peak_bytes
            s.zero_grad()
    return StepBytes(state, peak, comm.stats(), psi)


def measure_steps(names: list[str], config: GPTConfig, classes: dict[str, Any] | None = None, *,
                  batch_size: int, bucket_size_mb: float = 25.0) -> dict[str, StepBytes]:
    """On every rank of a real launch: `measure_step` for each strategy in `names`, one after another
    (what a simulation of the same world size is compared with)."""
    return {name: measure_step(name, config, classes, batch_size=batch_size, bucket_size_mb=bucket_size_mb)
            for name in names}


@contextmanager
def _compute_like_a_gpu(native_bf16: bool = True) -> Iterator[None]:
    """bf16 weights compute in bf16 inside the block (activations in bf16, as on a GPU), whatever this CPU does."""
    import os
    saved = os.environ.get("DISTLAB_NATIVE_BF16")
    if native_bf16:
        os.environ["DISTLAB_NATIVE_BF16"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("DISTLAB_NATIVE_BF16", None)
        else:
            os.environ["DISTLAB_NATIVE_BF16"] = saved


# ---- the simulation ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SimResult:
    """One strategy at one size, simulated as rank 0 of N (bytes; `seconds`: how long the simulation took)."""

    strategy: str
    world_size: int
    config: GPTConfig
    num_params: int
    model_state: ModelState
    peak_bytes: int
    comm: CommStats
    seconds: float
    predicted_model_state_bytes: float = field(default=0.0)
    predicted_comm_bytes_per_step: float = field(default=0.0)

    @property
    def comm_bytes_per_step(self) -> int:
        """Bytes sent by the gradient and parameter collectives of one step (the start-up broadcast aside)."""
        return sum(b for k, b in self.comm.bytes.items() if k != "broadcast")


def simulate(name: str, *, num_params: float | None = None, config: GPTConfig | None = None, world_size: int,
             classes: dict[str, Any] | None = None, micro_batch: int = 1, bucket_size_mb: float = 25.0,
             native_bf16: bool = True, steps: int | None = None) -> SimResult:
    """Simulate one training step of strategy `name` as rank 0 of `world_size`, with a model of
    `num_params` parameters (`scale_config`) or of `config`. Each rank trains `micro_batch` rows.

    `native_bf16=True` computes bf16 weights in bf16, as a GPU does (activations in bf16); False keeps
    this machine's choice (`distlab.engine.precision.compute_dtype`).
    """
    if config is None:
        if num_params is None:
            raise ValueError("give num_params (e.g. 7.5e9) or a GPTConfig")
        config = scale_config(num_params)
    start = time.perf_counter()
    with _compute_like_a_gpu(native_bf16), fake_world(world_size):
        out = measure_step(name, config, classes, batch_size=micro_batch * world_size,
                           bucket_size_mb=bucket_size_mb, steps=steps)
    stage, psi = STAGE[name], out.num_params
    return SimResult(name, world_size, config, psi, out.model_state, out.peak_bytes, out.comm,
                     time.perf_counter() - start,
                     predicted_model_state_bytes=zero_memory_per_device(psi, world_size, stage),
                     predicted_comm_bytes_per_step=comm_bytes_per_rank(psi, world_size, stage))


def simulate_table(num_params: float, world_size: int, classes: dict[str, Any] | None = None, *,
                   strategies: tuple[str, ...] = ("ddp", "zero1", "zero2", "zero3"), **kwargs: Any) -> list[SimResult]:
    """`simulate` each strategy at one size (rank 0 of `world_size`)."""
    return [simulate(name, num_params=num_params, world_size=world_size, classes=classes, **kwargs)
            for name in strategies]


def markdown(results: list[SimResult]) -> str:
    """A Markdown table of simulated results beside the closed forms (GB = 1e9 bytes)."""
    def gb(x: float) -> str:
        return f"{x / 1e9:.3f}" if x < 10e9 else f"{x / 1e9:.1f}"

    lines = ["| strategy | params | grads | optimizer | model states | formula | peak (with activations) "
             "| sent per step | formula | collectives per step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        s = r.model_state
        calls = ", ".join(f"{k} x{v}" for k, v in sorted(r.comm.calls.items()) if k != "broadcast")
        lines.append(f"| {r.strategy} | {gb(s.params)} | {gb(s.grads)} | {gb(s.optimizer_state)} | {gb(s.total)} "
                     f"| {gb(r.predicted_model_state_bytes)} | {gb(r.peak_bytes)} | {gb(r.comm_bytes_per_step)} "
                     f"| {gb(r.predicted_comm_bytes_per_step)} | {calls} |")
    return "\n".join(lines)


def describe(result: SimResult) -> str:
    """One line: the model and world a simulation ran."""
    c = result.config
    return (f"Simulated as rank 0 of {result.world_size} (fake backend, fake tensors): the course GPT with "
            f"{result.num_params / 1e9:.3g}B parameters (h = {c.d_model}, {c.n_layers} layers, {c.n_heads} heads, "
            f"vocabulary {c.vocab_size}), bf16 weights, {c.seq_len} tokens per row. Bytes in GB (1e9); "
            f"'sent' is algorithmic bytes per rank; the formulas are Ψ-exact closed forms (distlab.theory).")


# ---- the chapter-8 planner, checked against simulation ----------------------------------------------------

class _FirstStage(nn.Module):
    """Pipeline stage 0 of chapter 7's transformer as one device holds it: the embeddings, blocks [0, b),
    and the final norm and head when there is one stage."""

    def __init__(self, c: Any, layers: int, last: bool, positions: bool) -> None:
        from distlab.course.tensor_parallel.model import Block
        super().__init__()
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model) if positions else None
        self.blocks = nn.ModuleList(Block(c) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c.d_model) if last else None
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False) if last else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from distlab.course.tensor_parallel.model import run_blocks
        x = self.tok(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        x = run_blocks(self.blocks, x, "none")
        return self.head(self.ln_f(x)) if self.head is not None else x   # (B, S, V), or (B, S, h) to stage 1


def _tp_pp_zero3_states(spec: Any, layout: Any, seq_len: int, backward: bool = True) -> ModelState:
    """Rank 0 (pipeline stage 0) of a dp x tp x pp layout with ZeRO-3 over dp (FSDP2, as torchtitan composes
    it): chapter 7's transformer in bf16, its blocks tensor-parallel (`parallelize_blocks`, PyTorch's
    parallel styles, embeddings and head replicated), `fully_shard` per block and root on the dp mesh,
    `MixedPrecisionAdam`; one forward, backward and step; the model states at its end. `backward=False`
    gives every (sharded) parameter a zero gradient of its own shape and creates the optimizer states its
    first step would (fp32 master, m, v) without running forward, backward or the update: the same model
    states, for a fraction of the ops (no traffic is issued)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from distlab.course.pipeline.stages import stage_layers
    from distlab.course.tensor_parallel.model import TPConfig, parallelize_blocks
    L = layout
    with unset_fake_temporarily():
        mesh = init_device_mesh("cpu", (L.pp, L.dp, L.tp), mesh_dim_names=("pp", "dp", "tp"))
    c = TPConfig(vocab_size=spec.vocab_size, seq_len=seq_len, d_model=spec.d_model, n_heads=spec.n_heads,
                 n_layers=spec.n_layers)
    a, b = stage_layers(spec.n_layers, L.pp)[0]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        stage = _FirstStage(c, b - a, last=L.pp == 1, positions=spec.max_seq > 0)
    finally:
        torch.set_default_dtype(default)
    if L.tp > 1:
        parallelize_blocks(stage, mesh["tp"])
    if L.dp > 1:
        # With tp, FSDP2 joins the dp and tp meshes, which builds a mesh from real rank tensors: the fake
        # mode steps aside (the parameters stay fake: a fake tensor's ops run in its own fake mode).
        with unset_fake_temporarily():
            for block in stage.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(stage, mesh=mesh["dp"])
    opt = MixedPrecisionAdam(stage.parameters(), lr=LR)
    if backward:
        x = torch.randint(0, spec.vocab_size, (L.micro_batch, seq_len))
        stage(x).float().mean().backward()     # stage 0 of several: stands in for the gradient stage 1 sends back
        opt.step()
    else:   # what the first step leaves, without its arithmetic: a gradient and fp32 master, m, v per shard
        for p in stage.parameters():
            p.grad = torch.zeros_like(p)
            opt._state_for(p)
    return model_state(list(stage.parameters()), optimizer=opt)


@dataclass(frozen=True)
class PlanCheck:
    """The planner's model states per device (pipeline stage 0) against the same layout simulated."""

    name: str
    layout: str
    gpus: int
    num_params: int
    predicted_bytes: float
    simulated_bytes: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.simulated_bytes / self.predicted_bytes


def check_plan(spec: Any, layout: Any, *, seq_len: int = 4096, classes: dict[str, Any] | None = None,
               name: str = "", backward: bool = True) -> PlanCheck:
    """Simulate `layout` (a `distlab.course.planner.Layout`) for `spec` as rank 0 of its GPUs and compare the
    model states one device holds with `planner.plan`'s prediction for pipeline stage 0.

    ZeRO-3: FSDP2 over dp, with PyTorch's TP over tp and pipeline stage 0 of pp (as torchtitan composes
    them) on chapter 7's transformer; embeddings and head are replicated over tp, so the prediction is
    made with `vocab_parallel=False`. ZeRO-0/1/2 (dp only): the course GPT with DDP or the labs' classes
    (pass `classes`). `backward=False` skips the ZeRO-3 runs' forward and backward (zero gradients of
    each shard's shape instead: the same model states; see `_tp_pp_zero3_states`). Activations are not compared: the planner's Korthikanti model and the
    course models' saved tensors differ by design.
    """
    from distlab.course.planner import Workload, plan
    L = layout
    start = time.perf_counter()
    predicted = plan(spec, L, Workload(seq_len=seq_len, global_batch=L.dp * L.micro_batch * L.m),
                     vocab_parallel=False).model_state_bytes[0]
    if L.cp != 1:
        raise ValueError("context parallelism is not simulated: use cp=1")
    if L.zero == 3:
        with _compute_like_a_gpu(), fake_world(L.gpus):
            state = _tp_pp_zero3_states(spec, L, seq_len, backward)
    elif L.tp == 1 and L.pp == 1:
        strategy = {0: "ddp", 1: "zero1", 2: "zero2"}[L.zero]
        config = GPTConfig(vocab_size=spec.vocab_size, seq_len=seq_len, d_model=spec.d_model,
                           n_layers=spec.n_layers, n_heads=spec.n_heads)
        state = simulate(strategy, config=config, world_size=L.dp, classes=classes, steps=1).model_state
    else:
        raise ValueError(f"{L}: with tp or pp the simulation runs ZeRO-3 over dp (FSDP2) only; use zero=3")
    return PlanCheck(name or spec.name, str(L), L.gpus, spec.num_params, predicted, state.total,
                     time.perf_counter() - start)


def recipe_layouts() -> list[tuple[float, Any]]:
    """The source notes' recipes by model size, each on a GPU count it is used at: 7B data parallel with
    ZeRO-2 on 8 GPUs, 13B ZeRO-3 on 16, 70B ZeRO-3 + TP 8 on 64, 175B 3-D (dp 8 x tp 8 x pp 16) + ZeRO-3
    on 1024."""
    from distlab.course.planner import Layout
    return [(7e9, Layout(dp=8, zero=2)), (13e9, Layout(dp=16, zero=3)), (70e9, Layout(dp=8, tp=8, zero=3)),
            (175e9, Layout(dp=8, tp=8, pp=16, zero=3, m=16))]


def check_recipes(classes: dict[str, Any] | None = None, *, seq_len: int = 4096,
                  backward: bool = True) -> list[PlanCheck]:
    """`check_plan` for every recipe of `recipe_layouts` (the 7B one runs lab 4's ZeRO2: pass `classes`)."""
    from dataclasses import replace as with_
    from distlab.course.planner import ModelSpec
    out = []
    for size, layout in recipe_layouts():
        spec = with_(ModelSpec.from_size(size), max_seq=seq_len)    # learned positions, as the course models
        out.append(check_plan(spec, layout, seq_len=seq_len, classes=classes, name=f"{size / 1e9:g}B",
                              backward=backward))
    return out
