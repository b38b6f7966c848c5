"""One training loop for every strategy: real text, a sharded loader, checkpoints, a fault, a resume.

    cfg = TrainConfig(strategy="fsdp2", steps=200, ckpt_dir="ckpt", ckpt_every=50)
    runs = distlab.launch(train, 4, args=(cfg,))          # one Run per rank (rank 0's is the one to read)
    runs[0].loss                                          # the global batch's loss at every step

Every rank builds the same course GPT (vocabulary 256: bytes), reads its slice of each global batch of
B windows of T tokens from the stdlib corpus (`ShardedLoader`), and trains with the strategy `wrap` builds.
The loss logged is the global batch's: each rank's mean over its rows, averaged over ranks (one all-reduce
of a scalar per step; equal rows per rank make it the mean over all B·T tokens). Under `tp` and `dp_tp` the
ranks of one tensor-parallel group read the same rows and log the same loss, so the mean is unchanged.
Under `pp` only the last stage has a loss: it broadcasts it (one scalar from rank p - 1).
`step_fn` (default `training_step`, `pipeline_step` under `pp`) is the step itself: the lecture passes its
own, the same code.

Switches: `accumulate=k` splits each rank's rows into k micro-batches and communicates only in the last
backward (DDP's `no_sync`, FSDP2's `set_requires_gradient_sync`; under `pp` they are the schedule's m); `recompute=True` recomputes each block's
activations in backward (`torch.utils.checkpoint`); `resume=True`
continues from the newest complete checkpoint in `ckpt_dir`, at this run's world size and strategy;
`profile_dir` writes a `torch.profiler` Chrome trace per rank of two steps.

A fault: every step starts at `fault_point("step", step)`, where the launcher can kill a rank from outside
(`run_on_ranks(train, 4, args=(cfg,), fault=(3, "step 25"))`: rank 3 is SIGKILLed when it starts step 25).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distlab.engine.launch import fault_point
from distlab.course.models import GPTConfig, build_model, lm_loss
from distlab.course.training import checkpoint as ckpt
from distlab.course.training.corpus import VOCAB, corpus
from distlab.course.training.loader import ShardedLoader, validation_rows, windows
from distlab.course.training.pp import Pipeline, pipeline_eval, pipeline_loss, pipeline_step
from distlab.course.training.strategies import data_ranks, recompute_blocks, wrap


@dataclass(frozen=True)
class TrainConfig:
    strategy: str = "single"
    steps: int = 100
    batch_size: int = 16          # global rows per step (B), split over the data-parallel ranks
    seq_len: int = 64             # T
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    lr: float = 3e-3
    seed: int = 0
    max_bytes: int | None = None  # the first files of the corpus up to this many bytes (None: all of it)
    eval_every: int = 0           # validation loss every k steps (0: never)
    eval_batches: int = 2
    ckpt_dir: str | None = None
    ckpt_every: int = 0
    resume: bool = False
    accumulate: int = 1
    recompute: bool = False
    tp: int = 2                   # the tensor-parallel size of strategy "dp_tp" (the mesh is world/tp x tp)
    profile_dir: str | None = None

    def model_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=VOCAB, seq_len=self.seq_len, d_model=self.d_model, n_layers=self.n_layers,
                         n_heads=self.n_heads)


@dataclass
class Run:
    """What one rank saw. `loss[i]` is step `steps[i]`'s global loss (a resumed run carries the earlier
    steps from its checkpoint); `val` holds (step, loss) pairs; `step_s` the seconds of each step run here."""

    strategy: str
    world_size: int
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    resumed_from: int | None = None
    corpus: str = ""
    device: str = "cpu"           # the ranks' device type ("cuda" on GPUs) and, on GPUs, its name (for MFU)
    device_name: str = ""

    @property
    def tokens_per_s(self) -> float:
        """Global tokens per second over the median step run here (the first, a warm-up, left out)."""
        times = sorted(self.step_s[1:] or self.step_s)
        return self.tokens_per_step / times[len(times) // 2] if times else float("nan")


def _mean_over_ranks(x: torch.Tensor) -> float:
    if dist.is_initialized() and dist.get_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)                       # a scalar: the sum over ranks of equal-sized means
        x /= dist.get_world_size()
    return float(x)


def _global_loss(module: Any, value: torch.Tensor) -> float:
    """The global batch's loss from this rank's: a pipeline's last stage broadcasts it, the others average."""
    return pipeline_loss(value) if isinstance(module, Pipeline) else _mean_over_ranks(value)


def _validate(module: Any, tokens: torch.Tensor, cfg: TrainConfig, rank: int, n: int, device: Any) -> float:
    """The validation loss: rank `rank` of `n` data-parallel ranks evaluates its rows of fixed batches
    (a pipeline runs them forward only through its stages, in its m micro-batches)."""
    per = cfg.batch_size // n
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for ids in validation_rows((tokens.numel() - 1) // cfg.seq_len, cfg.eval_batches, cfg.batch_size):
            x, y = windows(tokens, ids[rank * per:(rank + 1) * per], cfg.seq_len)
            x, y = x.to(device), y.to(device)
            total += (pipeline_eval(module, x, y) if isinstance(module, Pipeline) else lm_loss(module, x, y)).detach()
    return _global_loss(module, total / cfg.eval_batches)


def _identity(cfg: TrainConfig, fingerprint: str) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the model's shape and the data."""
    return {"model": dataclasses.asdict(cfg.model_config()), "corpus": fingerprint,
            "data": {"batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "seed": cfg.seed}}


def foreign(meta: dict[str, Any], mine: dict[str, Any], strategy: str | None = None) -> str | None:
    """Why a checkpoint cannot be resumed by this run (None: it can). With `strategy`, also refuse to cross
    between a pipeline's checkpoint and the others' (DCP keys their optimizer states differently)."""
    for key, what in (("model", "a model of another shape"), ("corpus", "another corpus"), ("data", "other data settings")):
        if meta.get(key) != mine[key]:
            return f"it holds {what} ({key}: {meta.get(key)} here {mine[key]})"
    saved = meta.get("strategy")
    if strategy is not None and saved is not None and (saved == "pp") != (strategy == "pp"):
        return (f"it was saved by strategy {saved!r} and this run is {strategy!r}: a pp checkpoint keeps AdamW's "
                "state per parameter (flattened), the other strategies per optimizer, and the two do not load into "
                "each other. Resume a pp checkpoint with pp (at any world size the model splits over), the others "
                "with any strategy but pp")
    return None


def training_step(module: Any, opt: Any, sync_grads: Any, x: torch.Tensor, y: torch.Tensor, accumulate: int
                  ) -> torch.Tensor:
    """One step on this rank's rows: forward, loss, backward (k micro-batches, the strategy's gradient
    reduction in the last one only), the optimizer's step. Returns this rank's mean loss (a 0-d tensor)."""
    total = torch.zeros((), device=x.device)
    for i, (xm, ym) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
        if accumulate > 1:
            sync_grads(i == accumulate - 1)     # communicate in the last micro-batch's backward only
        loss = lm_loss(module, xm, ym) / accumulate
        loss.backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def train(cfg: TrainConfig, classes: dict[str, Any] | None = None, step_fn: Any = None) -> Run:
    """Train on every rank (or in one process); see the module's docstring. `step_fn(module, opt,
    sync_grads, x, y, accumulate)` runs one step and returns the rank's loss (default `training_step`)."""
    if step_fn is None:
        step_fn = pipeline_step if cfg.strategy == "pp" else training_step
    from distlab.engine import runtime as rt
    from distlab.meters.timing import sync
    n, r, device = rt.world_size(), rt.rank(), rt.device()
    text = corpus(cfg.max_bytes)
    mine = _identity(cfg, text.fingerprint)
    path = ckpt.latest(cfg.ckpt_dir) if cfg.resume and cfg.ckpt_dir else None
    if path is not None and (why := foreign(ckpt.read_meta(path), mine, cfg.strategy)):
        raise ValueError(f"cannot resume from {path}: {why}. Use another --out folder, or the same settings")
    dp_rank, dp = data_ranks(cfg.strategy, n, r, cfg.tp)     # tensor-parallel ranks read the same rows
    if cfg.accumulate < 1 or (cfg.batch_size // dp) % cfg.accumulate:
        raise ValueError(f"accumulate={cfg.accumulate} must divide each rank's {cfg.batch_size // dp} rows")
    model = build_model(cfg.model_config(), seed=cfg.seed, device=device)
    if cfg.recompute:
        recompute_blocks(model)
    module, opt, sync_grads = wrap(cfg.strategy, model, lr=cfg.lr, classes=classes, tp=cfg.tp,
                                   microbatches=cfg.accumulate)
    if cfg.accumulate > 1 and sync_grads is None:
        raise ValueError(f"strategy {cfg.strategy!r} cannot skip its gradient reduction: use accumulate=1")
    loader = ShardedLoader(text.train, seq_len=cfg.seq_len, batch_size=cfg.batch_size, rank=dp_rank, world_size=dp,
                           seed=cfg.seed, device=device)
    run = Run(cfg.strategy, n, tokens_per_step=cfg.batch_size * cfg.seq_len, corpus=text.fingerprint,
              device=device.type, device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    if path is not None:
        meta = ckpt.load(path, module, opt)
        loader.load_state_dict(meta["loader"])
        run.steps, run.loss = list(meta["steps"]), list(meta["loss"])
        run.val = [tuple(v) for v in meta["val"]]
        run.resumed_from = int(meta["step"])
    prof = _profiler(cfg, r, loader.step)
    for step in range(loader.step, cfg.steps):
        fault_point("step", step)                # the launcher's injected fault, when one is armed here
        rt.progress(f"{cfg.strategy}: step {step} of {cfg.steps}")
        sync(device)
        start = time.perf_counter()
        x, y = next(loader)
        total = step_fn(module, opt, sync_grads, x, y, cfg.accumulate)
        sync(device)
        run.step_s.append(time.perf_counter() - start)
        run.steps.append(step)
        run.loss.append(_global_loss(module, total))
        if prof is not None:
            prof.step()
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            run.val.append((step + 1, _validate(module, text.val, cfg, dp_rank, dp, device)))
        if cfg.ckpt_dir and cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0:
            ckpt.save(cfg.ckpt_dir, step + 1, module, opt,
                      {**mine, "strategy": cfg.strategy, "world_size": n, "loader": loader.state_dict(),
                       "steps": run.steps, "loss": run.loss, "val": run.val})
    if prof is not None:
        prof.stop()
    return run


def _profiler(cfg: TrainConfig, rank: int, first: int) -> Any:
    """A `torch.profiler` of two steps after one warm-up, exported as `rank{r}.json` (Chrome / Perfetto)."""
    if not cfg.profile_dir:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule
    out = Path(cfg.profile_dir)
    out.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                   on_trace_ready=lambda p: p.export_chrome_trace(str(out / f"rank{rank}.json")))
    prof.start()
    return prof
