"""A model's shape, as the planner reads it: GPT (the course's), or Llama-shaped (grouped-query attention,
a SwiGLU MLP, RMSNorm, no biases), either with a mixture of experts in every block (chapter 10: Mixtral).
Parameter counts are exact for all (tests/test_planner.py, tests/test_planner_moe.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from distlab.theory import planning as pt

# The seeds' recipe table by model size (2025): the reference the planner's choices are read against.
RECIPES = (
    (0, 10e9, "data parallel with ZeRO-1/2"),
    (10e9, 70e9, "ZeRO-3 (FSDP or DeepSpeed)"),
    (70e9, 175e9, "ZeRO-3 + tensor parallel (8+ GPUs)"),
    (175e9, float("inf"), "3-D parallelism: dp x tp x pp (+ ZeRO on dp)"),
)
LAPTOP_RECIPE = "ZeRO-Offload (slow, but it trains)"

# GPT shapes used when only a size is given: (size, layers, d_model, heads).
_SHAPES = ((1.3e9, 24, 2048, 16), (7e9, 32, 4096, 32), (13e9, 40, 5120, 40), (34e9, 48, 7168, 56),
           (70e9, 80, 8192, 64), (175e9, 96, 12288, 96), (405e9, 126, 16384, 128), (1e12, 128, 25600, 160))
# Llama 3 shapes (Dubey et al. 2024, Table 3): (size, layers, d_model, heads, kv heads, FFN width).
_LLAMA = ((8e9, 32, 4096, 32, 8, 14_336), (70e9, 80, 8192, 64, 8, 28_672), (405e9, 126, 16384, 128, 8, 53_248))
# Mixtral shapes (Jiang et al. 2024, Table 1; Mistral AI's 8x22B release): 8 SwiGLU experts, top-2, GQA 8 kv heads.
_MIXTRAL = ((46.7e9, 32, 4096, 32, 8, 14_336), (141e9, 56, 6144, 48, 8, 16_384))


def recipe(num_params: float, *, gpus: int = 8) -> str:
    """The seeds' rule of thumb for a model of `num_params` parameters."""
    if gpus <= 1:
        return LAPTOP_RECIPE
    return next(text for lo, hi, text in RECIPES if lo <= num_params < hi)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: `n_layers` blocks of width `d_model`, embeddings and a head.

    GPT by default (the course's models: learned positions up to `max_seq`, biases, LayerNorm, MLP of
    4 d, dropout, untied head). Llama-shaped models set `n_kv_heads` (grouped-query attention), `ffn`
    (the MLP's width), `gated` (SwiGLU: three matrices), `bias=False`, `norm="rmsnorm"`, `max_seq=0`
    (RoPE) and `dropout=False`. `tied`: the head reuses the input embedding (BLOOM). A mixture of experts
    (chapter 10) sets `n_experts` > 1 and `top_k`: every block's MLP becomes a router (d x E) and E experts
    of width `ffn`, k of them per token (`MIXTRAL_8X7B`); `num_params` counts all of them, `active_params`
    and the FLOPs per token only the k a token goes through.
    """

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int = 50_304
    max_seq: int = 4096             # learned position embeddings (0: none, e.g. RoPE or ALiBi)
    name: str = ""
    n_kv_heads: int | None = None   # grouped-query attention; None: one K and V head per query head
    ffn: int | None = None          # the MLP's hidden width; None: 4 d_model
    gated: bool = False             # SwiGLU (gate, up, down) instead of GeLU (up, down)
    bias: bool = True
    norm: str = "layernorm"         # or "rmsnorm"
    tied: bool = False              # head and input embedding share one matrix
    dropout: bool = True            # dropout masks kept for the backward (1 byte per element)
    n_experts: int = 0              # experts per block (0 or 1: a dense MLP); `ffn` is each expert's width
    top_k: int = 1                  # experts per token

    @classmethod
    def from_config(cls, config: Any, name: str = "", moe: Any = None) -> "ModelSpec":
        """From a `distlab.course.models.GPTConfig`: exactly the course model's parameter count. `moe`: a
        chapter 10 `MoEConfig` (n_experts, k, d_ff): every MLP a mixture of GeLU experts with biases, as
        `distlab.theory.moe.moe_gpt_params` counts them."""
        spec = cls(config.n_layers, config.d_model, config.n_heads, config.vocab_size, config.seq_len, name)
        if moe is None:
            return spec
        return cls(**{**spec.__dict__, "n_experts": moe.n_experts, "top_k": moe.k,
                      "ffn": moe.d_ff or 4 * config.d_model})

    @classmethod
    def from_size(cls, num_params: float, vocab_size: int = 128_256, family: str = "gpt") -> "ModelSpec":
        """A shape of about `num_params` parameters: the nearest common shape of `family` ("gpt", "llama" or
        "mixtral": 8 experts, top-2, `num_params` counting all of them), its depth rescaled.
        `from_size(405e9, family="llama")` is Llama 3 405B (405.9B)."""
        if family == "mixtral":
            _, layers, d, heads, kv, f = min(_MIXTRAL, key=lambda s: abs(math.log(s[0] / num_params)))
            spec = cls(layers, d, heads, vocab_size, 0, f"{num_params / 1e9:g}B (Mixtral-shaped)", kv, f, True,
                       False, "rmsnorm", False, False, 8, 2)
        elif family == "llama":
            _, layers, d, heads, kv, f = min(_LLAMA, key=lambda s: abs(math.log(s[0] / num_params)))
            spec = cls(layers, d, heads, vocab_size, 0, f"{num_params / 1e9:g}B (Llama-shaped)", kv, f, True,
                       False, "rmsnorm", False, False)
        elif family == "gpt":
            _, layers, d, heads = min(_SHAPES, key=lambda s: abs(math.log(s[0] / num_params)))
            spec = cls(layers, d, heads, vocab_size, 0, f"{num_params / 1e9:g}B")
        else:
            raise ValueError(f"unknown family {family!r}; choose gpt, llama or mixtral")
        rest = spec.num_params - spec.n_layers * spec.layer_params
        layers = max(1, round((num_params - rest) / spec.layer_params))
        return cls(**{**spec.__dict__, "n_layers": layers})

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        return 4 * self.d_model if self.ffn is None else self.ffn

    @property
    def kv_dim(self) -> int:
        return pt.kv_dim(self.d_model, self.n_heads, self.kv_heads)

    @property
    def moe(self) -> bool:
        return self.n_experts > 1

    @property
    def expert_params(self) -> int:
        """One expert's parameters (a mixture of experts), or the dense MLP's."""
        return pt.expert_params(self.d_model, self.ffn_dim, gated=self.gated, bias=self.bias)

    @property
    def layer_expert_params(self) -> int:
        """One block's expert parameters, all E of them (0 for a dense model): what ep shards."""
        return self.n_experts * self.expert_params if self.moe else 0

    @property
    def layer_params(self) -> int:
        """GPT: 12d^2 + 13d (qkv 3d^2+3d, proj d^2+d, fc 4d^2+4d, out 4d^2+d, two LayerNorms 4d)."""
        return pt.layer_params(self.d_model, self.n_heads, self.kv_heads, self.ffn_dim, gated=self.gated,
                               bias=self.bias, norm=self.norm, n_experts=self.n_experts)

    @property
    def layer_matmul_params(self) -> int:
        """The matrix weights a token goes through in one block (a mixture of experts: router + k experts)."""
        return pt.layer_matmul_params(self.d_model, self.n_heads, self.kv_heads, self.ffn_dim, gated=self.gated,
                                      n_experts=self.n_experts, top_k=self.top_k)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: all of a dense model's; a mixture of experts' less its E - k idle experts."""
        return self.num_params - (self.n_layers * (self.n_experts - self.top_k) * self.expert_params if self.moe else 0)

    @property
    def num_params(self) -> int:
        d, v = self.d_model, self.vocab_size
        head = 0 if self.tied else v * d
        return (self.n_layers * self.layer_params + v * d + self.max_seq * d + pt.norm_params(d, self.norm)
                + head)

    def flops_per_token(self, seq_len: int) -> float:
        """The model's FLOPs per trained token: 6 per matrix weight (blocks and head) + 12 L h s attention."""
        return pt.model_flops_per_token(self.n_layers * self.layer_matmul_params + self.vocab_size * self.d_model,
                                        self.n_layers, self.d_model, seq_len)


# Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3: 126 layers, d 16384, FFN 53248, 128 heads,
# 8 key/value heads, vocabulary 128K (128,256 in the released tokenizer), untied head: 405.9B parameters.
LLAMA_3_405B = ModelSpec(126, 16384, 128, 128_256, 0, "Llama 3 405B", n_kv_heads=8, ffn=53_248, gated=True,
                         bias=False, norm="rmsnorm", dropout=False)

# Jiang et al. 2024, "Mixtral of Experts" (arXiv:2401.04088), Table 1: 32 layers, dim 4096, hidden (expert)
# 14336, 32 heads, 8 key/value heads, vocabulary 32000, 8 experts, top-2; section 2.1: 46.7B parameters,
# 12.9B active per token (SwiGLU experts, RMSNorm, RoPE, untied head: 46.70B and 12.88B here).
MIXTRAL_8X7B = ModelSpec(32, 4096, 32, 32_000, 0, "Mixtral 8x7B", n_kv_heads=8, ffn=14_336, gated=True, bias=False,
                         norm="rmsnorm", dropout=False, n_experts=8, top_k=2)
