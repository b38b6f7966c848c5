"""Chapter 10's harness: the router's load over training steps, expert compute with and without capacity
padding, and model states per rank of an expert-parallel layout simulated at scale.

    loads = train_loads("tiny", MoEConfig(8, 2), steps=30, aux_weight=0.01)   # (steps, E) tokens per expert
    padded_experts(x, expert_idx, sizes, capacity, w1, w2) / grouped_experts(...)  # the two expert kernels
    ep_model_states(config, moe, world_size=64, ep=8)                          # rank 0 of 64, fake tensors

The expert-parallel code itself is the lecture's (and the lab's): this module holds what measures it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
import torch
import torch.nn.functional as F

from distlab.course.models import GPTConfig, synthetic_batch
from distlab.course.moe.layer import MoEConfig, MoEGPT, build_moe_model, moe_loss


# ---- the load over training steps (one process) ----------------------------------------------------------------

@dataclass(frozen=True)
class Loads:
    """What the routers of a short training did, per step: tokens per expert before capacity (summed over
    layers), kept after it, and the language-model loss (the router losses left out)."""

    assigned: torch.Tensor     # (steps, E)
    kept: torch.Tensor         # (steps, E)
    losses: list[float]

    def busiest_rank(self, ep: int) -> torch.Tensor:
        """Per step: the rows the busiest of ep ranks computes / a balanced rank's share of all assignments
        (T k / ep): the factor by which its experts' time exceeds a perfectly balanced step's."""
        per_rank = self.kept.view(len(self.kept), ep, -1).sum(2).double()
        return per_rank.max(1).values / (self.assigned.sum(1).double() / ep)

    def busiest_expert(self) -> torch.Tensor:
        """Per step: the rows of the busiest expert / a balanced expert's share (T k / E)."""
        return self.kept.max(1).values.double() / (self.assigned.sum(1).double() / self.kept.shape[1])

    @property
    def dropped(self) -> float:
        """The fraction of assignments dropped by the capacity, over the whole run."""
        return float(1 - self.kept.sum() / self.assigned.sum())


def train_loads(preset: str | GPTConfig, moe: MoEConfig, *, steps: int, batch_size: int, aux_weight: float,
                z_weight: float = 0.0, lr: float = 3e-3, seed: int = 0) -> Loads:
    """Train the MoE GPT in one process (AdamW, one intra-op thread) and record its routers' load per step."""
    from distlab.course.data_parallel.reference import one_thread
    with one_thread():
        model = build_moe_model(preset, moe, seed=seed, device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        assigned, kept, losses = [], [], []
        for step in range(steps):
            x, y = synthetic_batch(step, batch_size, model.config, seed=seed, device="cpu")
            loss = moe_loss(model, x, y, aux_weight=aux_weight, z_weight=z_weight)
            loss.backward()
            routers = sum(aux_weight * m.stats.aux_loss + z_weight * m.stats.z_loss for m in model.moe_layers())
            opt.step()
            opt.zero_grad(set_to_none=True)
            layers = model.moe_layers()
            assigned.append(sum(m.stats.assigned.sum(0) for m in layers))
            kept.append(sum(m.stats.kept.sum(0) for m in layers))
            losses.append(loss.item() - float(routers.detach()))
    return Loads(torch.stack(assigned), torch.stack(kept), losses)


# ---- the experts' compute: padded to a capacity, or grouped by size ---------------------------------------------

def expert_weights(n_experts: int, d_model: int, d_ff: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights (E, h, f) and (E, f, h), as a grouped kernel wants them."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_experts, d_model, d_ff, generator=g) / d_model ** 0.5,
            torch.randn(n_experts, d_ff, d_model, generator=g) / d_ff ** 0.5)


def padded_experts(x: torch.Tensor, sizes: list[int], capacity: int, w1: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    """Capacity routing's kernel: every expert's rows (x sorted by expert, `sizes` rows each) cut or zero-padded
    to `capacity`, then one batched matmul (E, C, h) x (E, h, f): a fixed shape, C x E rows of work."""
    e, h = w1.shape[0], x.shape[1]
    buf = x.new_zeros(e, capacity, h)
    for i, part in enumerate(x.split(sizes)):
        buf[i, :min(len(part), capacity)] = part[:capacity]
    return torch.bmm(F.gelu(torch.bmm(buf, w1)), w2)


def grouped_experts(x: torch.Tensor, sizes: list[int], w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Dropless routing's kernel: one matmul per group of variable size (what a grouped GEMM does in one
    launch on a GPU); exactly sum(sizes) rows of work."""
    return torch.cat([F.gelu(part @ w1[i]) @ w2[i] for i, part in enumerate(x.split(sizes))])


# ---- model states per rank at scale, simulated --------------------------------------------------------------

MIXTRAL_LIKE = (GPTConfig(vocab_size=32000, seq_len=4096, d_model=4096, n_layers=32, n_heads=32),
                # Mixtral's experts are SwiGLU MLPs (3 h x 14336 weights); the course's GeLU expert with
                # d_ff = 21504 holds the same 2 h x 21504 weights.
                MoEConfig(n_experts=8, k=2, d_ff=21504))


def ep_rank_model(config: GPTConfig, moe: MoEConfig, ep: int) -> MoEGPT:
    """Rank 0's part of the MoE GPT in bf16 under expert parallelism: every dense weight (router included)
    whole, E/ep experts per layer."""
    from distlab.course.models import Linear
    if moe.n_experts % ep:
        raise ValueError(f"{moe.n_experts} experts do not split over ep = {ep}")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = MoEGPT(config, replace(moe, n_experts=moe.n_experts // ep))
        for m in model.moe_layers():
            m.router = Linear(config.d_model, moe.n_experts, bias=False)
            m.n_experts = moe.n_experts
    finally:
        torch.set_default_dtype(default)
    return model


@dataclass(frozen=True)
class EPStates:
    """One layout simulated as rank 0 of `world_size`: parameters held and model-state bytes per rank."""

    world_size: int
    ep: int
    dense_params: int
    expert_params: int          # the experts this rank holds
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def ep_model_states(config: GPTConfig, moe: MoEConfig, *, world_size: int, ep: int) -> EPStates:
    """Rank 0 of `world_size` (fake backend, fake tensors): its part of the model in bf16, its bf16 gradients
    and `MixedPrecisionAdam`'s fp32 master, m and v after one optimizer step, measured by `model_state`.
    The gradients come from a backward that touches every weight once (the routing of a real forward is
    data-dependent, which fake tensors do not have; model states do not depend on it)."""
    from distlab.course.sim.world import fake_world
    from distlab.engine.precision import MixedPrecisionAdam
    from distlab.meters import model_state
    with fake_world(world_size):
        model = ep_rank_model(config, moe, ep)
        opt = MixedPrecisionAdam(model.parameters(), lr=1e-4)
        sum(p.float().sum() for p in model.parameters()).backward()
        opt.step()
        state = model_state(model, optimizer=opt)
        experts = sum(p.numel() for m in model.moe_layers() for p in m.experts.parameters())
        total = sum(p.numel() for p in model.parameters())
    return EPStates(world_size, ep, total - experts, experts, state.params, state.grads, state.optimizer_state)


def dense_and_expert_params(config: GPTConfig, moe: MoEConfig) -> tuple[int, int]:
    """(dense, all experts) parameters of the whole MoE GPT, from `distlab.theory.moe`."""
    from distlab.theory.moe import expert_params, moe_gpt_params
    total, _ = moe_gpt_params(config.vocab_size, config.seq_len, config.d_model, config.n_layers, moe.n_experts,
                              moe.k, moe.d_ff)
    experts = config.n_layers * moe.n_experts * expert_params(config.d_model, moe.d_ff or config.d_ff)
    return total - experts, experts
