"""The layout planner: which (dp, tp, pp, cp, ZeRO stage, micro-batches, chunks, recomputation) to train a
model with.

    spec = ModelSpec.from_size(70e9)                            # a GPT-shaped 70B model (family="llama": GQA, SwiGLU)
    # or MIXTRAL_8X7B: a mixture of experts (chapter 10), whose layouts also choose ep
    plans = candidates(spec, Workload(seq_len=4096, global_batch=1024), Cluster(gpus=256))
    print(markdown(plans[:5]))                                  # ranked: fits, then estimated step; assumptions
    planner()                                                   # the same as a widget in Jupyter

Every prediction is a closed form over the model's shape (`ModelSpec`; the closed forms live in
`distlab.theory.pipeline` and `distlab.theory.planning`): model states per device by pipeline stage (the
first stage holds the embeddings, the last the head), activations by schedule (1F1B, or interleaved with
v chunks per rank), bytes each device sends per step in each group (dp, tp, pp, cp; ep and edp for a mixture
of experts) and on which link
(NVLink inside a node, the cluster's NICs between nodes, by the course's one mesh order, outermost first
(pp, dp, ep, cp, tp): the heaviest, latency-critical traffic on neighbouring ranks of one node, the lightest
(pp's point-to-point activations) on the groups that span nodes), the bubble, and the step time term by
term (`Plan.times`), with a latency per collective. `plan(...)` is one layout; `candidates(...)`
enumerates and ranks them. Pure functions: chapter 8 checks them against the layouts it measures on CPU
ranks, and tools/planner_vs_published.py against layouts published for large training runs.

Assumptions, stated once (and with every table, `assumptions(cluster)`): Megatron-style tensor
parallelism (2 all-reduces of the activation in each block's forward, 2 in its backward, norms and
row-parallel biases replicated), vocabulary-parallel embedding and head when `vocab_parallel`
(replicated otherwise, as in the chapter's own 3-D code), ZeRO over dp, mixed-precision Adam (2 + 2 + 12
bytes per parameter) unless told otherwise, activations per layer as in Korthikanti et al. (2022) with
sequence parallelism (`distlab.theory.planning.activation_bytes_per_layer`), without the attention
scores under FlashAttention (the default). Mixtures of experts (chapter 10): FLOPs per token count the
active parameters; E/ep experts per device, split over tp or whole (`Layout.etp` = 1, MoE Parallel Folding);
per MoE block and micro-batch four all-to-alls of the device's tokens x k rows (and one of counts), each
N - 1 sends (`theory.planning.collective_s("all_to_all", ...)`), on NVLink when the ep group is in a node,
else through the cluster's NICs; routing uniform unless `imbalance` says how much busier the busiest rank is.

Modules: shapes (ModelSpec, recipes), layout (Workload, Cluster, Layout, Plan), estimate (plan, the step's
terms), rank (candidates, frameworks, markdown, assumptions), widget (planner).
"""
from __future__ import annotations

from distlab.course.planner.estimate import AXES, block_params, expert_block_params, local_params, plan, step_terms
from distlab.course.planner.layout import GB, RECOMPUTE, Cluster, Layout, Plan, Workload
from distlab.course.planner.rank import assumptions, candidates, frameworks, markdown, rank_key
from distlab.course.planner.shapes import LAPTOP_RECIPE, LLAMA_3_405B, MIXTRAL_8X7B, RECIPES, ModelSpec, recipe
from distlab.course.planner.widget import FAMILIES, GPUS, planner

__all__ = ["AXES", "FAMILIES", "GB", "GPUS", "LAPTOP_RECIPE", "LLAMA_3_405B", "MIXTRAL_8X7B", "RECIPES", "RECOMPUTE",
           "Cluster", "Layout", "ModelSpec", "Plan", "Workload", "assumptions", "block_params", "candidates",
           "expert_block_params", "frameworks",
           "local_params", "markdown", "plan", "planner", "rank_key", "recipe", "step_terms"]
