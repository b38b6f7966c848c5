"""`simulate`: one strategy at one size as rank 0 of N on fake tensors, beside the closed forms; and its table."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from distlab.course.models import GPTConfig
from distlab.course.sim.step import STAGE, measure_step, scale_config
from distlab.course.sim.world import compute_like_a_gpu, fake_world
from distlab.meters import CommStats, ModelState
from distlab.theory import comm_bytes_per_rank, zero_memory_per_device

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
    with compute_like_a_gpu(native_bf16), fake_world(world_size):
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
