"""`distlab train`: the course GPT on the standard library's source, with a chosen strategy and world size.

    distlab train --strategy fsdp2 --world-size 4 --steps 200 --out run/
    distlab train --strategy fsdp2 --world-size 2 --steps 300 --out run/ --resume     # continues run/ on 2 ranks
    distlab train --strategy zero3 --world-size 2 --notebook labs/05_zero3.ipynb --out mine/   # your ZeRO-3
    distlab train --strategy dp_tp --world-size 4 --steps 300 --out run/ --resume     # run/ on a 2 x 2 mesh
    distlab train --strategy pp --world-size 2 --out pp/          # 2 stages, 4 micro-batches (--accumulate)
    torchrun --nproc-per-node 4 -m distlab.apps.train --strategy fsdp2 --out run/      # under torchrun

Writes to `--out`: `checkpoints/step_NNNNNN/` (torch.distributed.checkpoint, written to a hidden folder and
renamed when complete), `loss.json` (every step's loss, validation points, tokens/s) and `loss.png`.
The loop is `distlab.course.training.train` (lecture 9); a checkpoint of another model, corpus or data
settings is refused with the reason.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

PRESETS = {   # model and batch per preset (the corpus is the whole standard library unless --max-bytes)
    "tiny": dict(batch_size=8, seq_len=32, d_model=32, n_layers=2, n_heads=2),
    "small": dict(batch_size=16, seq_len=64, d_model=64, n_layers=2, n_heads=4),
    "medium": dict(batch_size=32, seq_len=128, d_model=128, n_layers=4, n_heads=4),
}
PP_MICRO_BATCHES = 4   # pp's default micro-batches per step: divides every preset's batch


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from distlab.course.training.strategies import STRATEGIES
    t = sub.add_parser("train", help="train the course GPT on real text with a strategy and world size")
    _arguments(t, STRATEGIES)
    return t


def _arguments(t: argparse.ArgumentParser, strategies: tuple[str, ...]) -> None:
    t.add_argument("--strategy", default="single", help=f"one of {', '.join(strategies)} (default single)")
    t.add_argument("--world-size", type=int, default=1, help="ranks (default 1; ignored under torchrun)")
    t.add_argument("--steps", type=int, default=200, help="train until this step (default 200)")
    t.add_argument("--out", type=Path, default=Path("results/train"), help="output folder (default results/train)")
    t.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    t.add_argument("--preset", default="small", choices=sorted(PRESETS), help="model and batch size (default small)")
    t.add_argument("--ckpt-every", type=int, default=50, help="checkpoint every k steps (default 50; 0: never)")
    t.add_argument("--eval-every", type=int, default=25, help="validation loss every k steps (default 25)")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--max-bytes", type=int, default=None, help="read only the first files, up to this many bytes")
    t.add_argument("--accumulate", type=int, default=None,
                   help="micro-batches per step (gradient accumulation; under pp the pipeline schedule's micro-batches). "
                        f"Default 1, and {PP_MICRO_BATCHES} under pp: a pipeline of one micro-batch has no overlap")
    t.add_argument("--recompute", action="store_true", help="recompute each block's activations in backward")
    t.add_argument("--notebook", type=Path, default=None,
                   help="zero1/2/3: your lab notebook with the class (default: the shipped solution)")


def accumulate(args: argparse.Namespace) -> int:
    """--accumulate as given; if not given, 1, or under pp PP_MICRO_BATCHES (whatever the world size, so that a
    pp run resumed on another number of stages keeps its micro-batches and its curve)."""
    if args.accumulate is not None:
        return args.accumulate
    return PP_MICRO_BATCHES if args.strategy == "pp" else 1


def config(args: argparse.Namespace) -> Any:
    from distlab.course.training import TrainConfig
    return TrainConfig(strategy=args.strategy, steps=args.steps, lr=args.lr, max_bytes=args.max_bytes,
                       eval_every=args.eval_every, ckpt_dir=str(args.out / "checkpoints"),
                       ckpt_every=args.ckpt_every, resume=args.resume, accumulate=accumulate(args),
                       recompute=args.recompute, **PRESETS[args.preset])


def validate(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, in a learner's words (None: nothing)."""
    from distlab.course.training import check_strategy, data_ranks
    from distlab.course.training.loop import foreign, _identity
    from distlab.course.training import checkpoint as ckpt
    cfg = config(args)
    try:
        check_strategy(args.strategy, args.world_size, {"ShardedOptimizer": 0, "ZeRO2": 0, "ZeRO3": 0}, tp=cfg.tp,
                       n_heads=cfg.n_heads, n_layers=cfg.n_layers, microbatches=cfg.accumulate)
    except ValueError as exc:
        return str(exc)
    dp = data_ranks(args.strategy, args.world_size, 0, cfg.tp)[1]      # the ranks that split the batch
    if cfg.batch_size % dp:
        return (f"the global batch of {cfg.batch_size} rows (preset {args.preset}) does not split over "
                f"{dp} ranks (the data-parallel ones): use a world size that divides {cfg.batch_size}")
    if args.steps < 1 or cfg.accumulate < 1 or (cfg.batch_size // dp) % cfg.accumulate:
        return f"--steps must be >= 1 and --accumulate must divide each rank's {cfg.batch_size // dp} rows"
    if args.resume:
        path = ckpt.latest(cfg.ckpt_dir)
        if path is None:
            return f"--resume: no complete checkpoint in {cfg.ckpt_dir}"
        from distlab.course.training import corpus
        why = foreign(ckpt.read_meta(path), _identity(cfg, corpus(cfg.max_bytes).fingerprint), cfg.strategy)
        if why:
            return f"--resume: {path} cannot be continued by this run: {why}"
    return None


def _rank_main(cfg: Any, classes: dict[str, Any]) -> Any:
    from distlab.course.training import train
    return train(cfg, classes)


def plot(run: Any, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(run.steps, run.loss, label="train")
    if run.val:
        ax.plot(*zip(*run.val), "o-", label="validation")
    if run.resumed_from is not None:
        ax.axvline(run.resumed_from, color="grey", ls="--", lw=1, label=f"resumed at step {run.resumed_from}")
    ax.set_xlabel("step"); ax.set_ylabel("loss (nats per byte)")
    ax.set_title(f"{run.strategy} on {run.world_size} rank(s), {run.corpus}", fontsize=8)
    ax.legend(fontsize=8); fig.tight_layout()
    path = out / "loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_run(run: Any, out: Path) -> Path:
    path = out / "loss.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"strategy": run.strategy, "world_size": run.world_size, "steps": run.steps,
                               "loss": run.loss, "val": run.val, "tokens_per_s": run.tokens_per_s,
                               "resumed_from": run.resumed_from, "corpus": run.corpus}))
    tmp.replace(path)
    return path


def run(args: argparse.Namespace) -> int:
    import distlab
    from distlab.apps.simulate import lab_class
    why = validate(args)
    if why:
        print(f"distlab train: {why}", file=sys.stderr)
        return 2
    try:
        classes = lab_class(args.strategy, args.notebook)
    except (FileNotFoundError, ValueError) as exc:
        print(f"distlab train: {exc}", file=sys.stderr)
        return 2
    cfg = config(args)
    args.out.mkdir(parents=True, exist_ok=True)
    from tqdm.auto import tqdm
    from distlab.course.training import checkpoint as ckpt
    start = time.perf_counter()
    with tqdm(total=args.steps, desc=f"distlab train {args.strategy} x{args.world_size}", unit="step",
              dynamic_ncols=True) as bar:
        # The ranks train; the bar follows the checkpoint folder (a step lands there every --ckpt-every).
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["runs"] = distlab.launch(_rank_main, args.world_size, args=(cfg, classes))
            except Exception as exc:   # noqa: BLE001 - reported below
                box["error"] = exc
        th = threading.Thread(target=work, daemon=True)
        th.start()
        while th.is_alive():
            th.join(0.5)
            latest = ckpt.latest(cfg.ckpt_dir)
            if latest is not None:
                bar.n = max(bar.n, int(latest.name.split("_")[1]))
                bar.refresh()
        bar.n = args.steps if "runs" in box else bar.n
        bar.refresh()
    if "error" in box:
        print(f"distlab train: {str(box['error']).splitlines()[0]}", file=sys.stderr)
        last = ckpt.latest(cfg.ckpt_dir)
        if last is not None:
            print(f"the newest complete checkpoint is {last}: continue with --resume", file=sys.stderr)
        return 1
    result = box["runs"][0]
    save_run(result, args.out)
    png = plot(result, args.out)
    val = f", validation {result.val[-1][1]:.3f}" if result.val else ""
    print(f"loss {result.loss[0]:.3f} -> {result.loss[-1]:.3f}{val} in {time.perf_counter() - start:.0f} s, "
          f"{result.tokens_per_s:,.0f} tokens/s; {png}, {args.out / 'loss.json'}, checkpoints in {cfg.ckpt_dir}")
    from distlab.course.training.throughput import flops_per_token, gpu_peak_flops, mfu
    peak = gpu_peak_flops(result.device_name) if result.device == "cuda" else None
    if peak:       # on GPUs the course knows: the model's FLOPs per token against the bf16 peak
        print(f"MFU {mfu(result.tokens_per_s, flops_per_token(cfg.model_config()), result.world_size, peak):.1%} "
              f"of {result.world_size} x {result.device_name}'s bf16 peak")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Under torchrun: every process trains as one rank (env://); rank 0 writes the loss files."""
    from distlab.course.training.strategies import STRATEGIES
    ap = argparse.ArgumentParser(prog="python -m distlab.apps.train")
    _arguments(ap, STRATEGIES)
    args = ap.parse_args(argv)
    import distlab
    from distlab.apps.simulate import lab_class
    result = distlab.run_under_torchrun(_rank_main, config(args), lab_class(args.strategy, args.notebook))
    if os.environ.get("RANK", "0") == "0" and result is not None:   # the group is gone: ask the environment
        args.out.mkdir(parents=True, exist_ok=True)
        save_run(result, args.out)
        plot(result, args.out)
    return 0


if __name__ == "__main__":
    from distlab.engine.runtime import end_rank
    end_rank(main())   # under torchrun: the rank ends without finalizing the interpreter (see end_rank)
