"""Chapter 8's planner read against layouts published for the largest training runs (issue 40).

    from distlab.course.planner.published import RUNS, compare, table
    print(table([compare(run) for run in RUNS]))     # or: python tools/planner_vs_published.py
    print(table([compare(run) for run in MOE_RUNS])) # mixtures of experts (issue 37): published benchmark layouts

For each published run: the model's shape, the cluster and the layout as the paper gives them, and
the figures the paper reports. `compare` asks the planner (`distlab.course.planner`) for every
candidate layout of that cluster and batch, finds the published layout among them (fields the paper
does not state are left to the planner: it takes the best-ranked candidate that matches every stated
field), and `table` prints its rank, its estimated step against the planner's favourite, and its estimated
MFU against the published one. Nothing here is tuned to the published figures: the planner's
constants come from its own stated sources.

Published MFU: Llama 3 reports MFU itself. The Megatron-LM, MT-NLG and BLOOM figures are achieved
TFLOP/s per GPU counted with Megatron's formula *with* full activation recomputation,
96 B s l h^2 (1 + s/6h + V/16lh) per step (Narayanan et al. 2021, eq. in section 5.1); the model's
own FLOPs are 72 B s l h^2 (1 + s/6h + V/12lh), so MFU = TFLOP/s x 72(1 + s/6h + V/12lh) /
(96(1 + s/6h + V/16lh)) / peak.

The "before" figures were measured with this module's legacy path at commit 41f63c8 (the planner
before issue 40: GPT shapes only, 1F1B only, one NIC figure per GPU kind, recompute all or nothing);
re-measure with `git archive 41f63c8 distlab | tar -x -C /tmp/before` and `PYTHONPATH=/tmp/before
python tools/planner_vs_published.py` (this module is loaded from its file and detects the old API).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distlab.course import planner as pl
from distlab.theory.hardware import A100, H100

NEW_API = hasattr(pl, "LLAMA_3_405B")
MOE_API = hasattr(pl, "MIXTRAL_8X7B")          # the planner knows expert parallelism (issue 37)


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    gpu: Any
    gpus: int
    shape: dict                      # ModelSpec fields (GPT: n_layers, d_model, n_heads, vocab_size, max_seq)
    seq_len: int
    global_batch: int                # sequences per step
    layout: dict                     # the stated fields: dp, tp, pp, cp, zero, micro_batch, recompute, v
    tflops: float = 0.0              # achieved TFLOP/s per GPU (Megatron's count, with full recomputation)
    mfu: float = 0.0                 # published MFU, where the paper gives it
    nic_GBps: float | None = None    # per GPU, per direction, from the cluster's NICs
    notes: str = ""
    extra: dict = field(default_factory=dict)   # shape fields the planner before issue 40 could not express
    software: dict = field(default_factory=dict)   # what the run's framework lacked (plan options)


# 2021-22 software: no FlashAttention (2022) and no sequence parallelism (Korthikanti et al. 2022) yet; the
# planner is asked with the same software, so its alternatives are ones that run could have chosen.
OLD = dict(flash_attention=False, sequence_parallel=False)
GPT3_175B = dict(n_layers=96, d_model=12288, n_heads=96, vocab_size=51_200, max_seq=2048)
GPT_530B = dict(n_layers=105, d_model=20480, n_heads=128, vocab_size=51_200, max_seq=2048)
RUNS = [
    # Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
    # SC'21 (arXiv:2104.04473), Table 2 (PTD-P rows): 175B on 1536 A100 80GB (Selene: 8 x 200 Gb/s HDR per
    # node), tensor 8 x pipeline 12, batch 1536 of 2048 tokens, 141 TFLOP/s per GPU; full recomputation.
    Run("Megatron-LM 175B", "Narayanan et al. 2021, Table 2", A100, 1536, GPT3_175B, 2048, 1536,
        dict(dp=16, tp=8, pp=12, cp=1, zero=0, micro_batch=1, recompute="full"), tflops=141,
        nic_GBps=8 * 200 / 8 / 8, software=OLD,
        notes="no distributed optimizer in Megatron-LM 2021 (ZeRO-0); schedule (v) not in the table: the planner's best v"),
    # Same table: 530B (105 layers, h 20480, 128 heads) on 2240 GPUs, tensor 8 x pipeline 35, batch 2240, 159 TFLOP/s.
    Run("Megatron-LM 530B", "Narayanan et al. 2021, Table 2", A100, 2240, GPT_530B, 2048, 2240,
        dict(dp=8, tp=8, pp=35, cp=1, zero=0, micro_batch=1, recompute="full"), tflops=159,
        nic_GBps=8 * 200 / 8 / 8, software=OLD,
        notes="no distributed optimizer in Megatron-LM 2021 (ZeRO-0); schedule (v) not in the table: the planner's best v"),
    # Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B" (arXiv:2201.11990),
    # sections 2.4 and 3: 420 DGX A100 (3360 GPUs), tensor 8 x pipeline 35 x data 12, batch 1920 of 2048
    # tokens, 44.4 s per iteration = 113 TFLOP/s per GPU; DeepSpeed's pipeline engine (1F1B).
    Run("MT-NLG 530B", "Smith et al. 2022, sec. 2.4", A100, 3360, dict(GPT_530B, vocab_size=50_272), 2048, 1920,
        dict(dp=12, tp=8, pp=35, cp=1, recompute="full", v=1), tflops=113, nic_GBps=8 * 200 / 8 / 8,
        software=OLD, notes="micro-batch and ZeRO stage not stated: the planner's best"),
    # Le Scao et al. 2022, "BLOOM" (arXiv:2211.05100), section 3.4 and Bekman, "The Technology Behind BLOOM
    # Training" (Hugging Face blog, 2022): 48 nodes of 8 A100 80GB on Jean Zay, 4 x 100 Gb/s Omni-Path per node;
    # 70 layers, h 14336, 112 heads, vocabulary 250880 (padded), ALiBi; tp 4 x pp 12 x dp 8, micro-batch 2,
    # batch 2048 of 2048 tokens, ZeRO-1, Megatron-DeepSpeed (1F1B), about 150 TFLOP/s per GPU.
    Run("BLOOM 176B", "Le Scao et al. 2022, sec. 3.4", A100, 384,
        dict(n_layers=70, d_model=14336, n_heads=112, vocab_size=250_880, max_seq=0), 2048, 2048,
        dict(dp=8, tp=4, pp=12, cp=1, zero=1, micro_batch=2, recompute="full", v=1), tflops=150,
        nic_GBps=4 * 100 / 8 / 8, notes="recomputation assumed full (Megatron-DeepSpeed's checkpoint-activations)",
        extra=dict(tied=True), software=OLD),
]
# Dubey et al. 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 4 (scaling configurations) and
# section 3.3: H100 80GB at 700 W, 8 x 400 Gb/s RoCE per node; tp 8, pp 16, cp as listed, 16M tokens per
# batch; MFU 43 %, 41 %, 38 %. Shape (section 3.2, Table 3): 126 layers, d 16384, FFN 53248 (SwiGLU),
# 128 heads, 8 KV heads, vocabulary 128k (128,256 in the released tokenizer), RoPE.
LLAMA = dict(n_layers=126, d_model=16384, n_heads=128, vocab_size=128_256, max_seq=0)
LLAMA_EXTRA = dict(n_kv_heads=8, ffn=53_248, gated=True, bias=False, norm="rmsnorm")
for gpus, dp, cp, seq, per_dp, mfu in ((8192, 64, 1, 8192, 32, 0.43), (16384, 128, 1, 8192, 16, 0.41),
                                       (16384, 8, 16, 131_072, 16, 0.38)):
    RUNS.append(Run(f"Llama 3 405B, {gpus} GPUs, {seq // 1024}k", "Dubey et al. 2024, Table 4", H100, gpus,
                    LLAMA, seq, dp * per_dp, dict(dp=dp, tp=8, pp=16, cp=cp, micro_batch=1), mfu=mfu,
                    nic_GBps=8 * 400 / 8 / 8, extra=LLAMA_EXTRA,
                    notes="micro-batch 1 assumed; ZeRO stage, recomputation and v not stated: the planner's best"))


# Mixtures of experts (issue 37). No training run of a mixture of experts on GPUs publishes its layout with the
# model's shape and a throughput in a form the planner can read: Mixtral's paper (Jiang et al. 2024) gives
# neither cluster nor layout; DeepSeek-V3's report (DeepSeek-AI 2024, arXiv:2412.19437, sec. 3.2-3.3: 2048 H800,
# pp 16, ep 64 over 8 nodes, ZeRO-1 dp, no tp, FP8, DualPipe) uses multi-head latent attention, a shared expert
# and dense first layers, none of which the planner's shapes express. What is published instead are NVIDIA's
# Megatron Core benchmark configurations (the Megatron-MoE-ModelZoo of Liu et al. 2025, "MoE Parallel Folding",
# arXiv:2504.14960): github.com/yanring/Megatron-MoE-ModelZoo, runtime_configs/benchmarking/runtime.conf
# (TP PP EP CP VPP MBS GBS, nodes of 8 H100, sequence 4096), model_configs/benchmarking/Mixtral-8x22B.yaml
# (56 layers, h 6144, FFN 16384, 48 heads, 8 query groups, SwiGLU, RMSNorm, untied, Llama 2 tokenizer: vocabulary
# 32000; distributed optimizer (ZeRO-1), sequence parallel, FlashAttention, no recomputation, bf16, expert
# tensor parallelism 1) and best_practice/Mixtral/run_mixtral_8x22B.sh ("around 455 TFLOPS for H100", dropless).
# Benchmarks, not training runs; the throughput is Megatron's count of the model's FLOPs (active experts,
# attention, no recomputation), so MFU = 455 / 989. The 8x7B line states no throughput.
MIXTRAL_SHAPE = dict(n_layers=32, d_model=4096, n_heads=32, vocab_size=32_000, max_seq=0)
MIXTRAL_EXTRA = dict(n_kv_heads=8, ffn=14_336, gated=True, bias=False, norm="rmsnorm", dropout=False, n_experts=8,
                     top_k=2)
ZOO = "Megatron-MoE-ModelZoo (Liu et al. 2025), runtime.conf"
H100_NIC = 8 * 400 / 8 / 8                           # the zoo's H100 nodes: InfiniBand 8 x 50 GB/s
MOE_RUNS = [
    Run("Mixtral 8x7B (Megatron Core benchmark)", ZOO, H100, 64, MIXTRAL_SHAPE, 4096, 256,
        dict(dp=16, tp=1, pp=4, cp=1, ep=8, zero=1, micro_batch=1, v=8, recompute="none"), nic_GBps=H100_NIC,
        extra=MIXTRAL_EXTRA, notes="no throughput stated: MFU not compared; ZeRO-1 = the distributed optimizer"),
    Run("Mixtral 8x22B (Megatron Core benchmark)", ZOO + ", Mixtral-8x22B.yaml, run_mixtral_8x22B.sh", H100, 128,
        dict(n_layers=56, d_model=6144, n_heads=48, vocab_size=32_000, max_seq=0), 4096, 256,
        dict(dp=8, tp=2, pp=8, cp=1, ep=8, etp=1, zero=1, micro_batch=1, v=1, recompute="none"), tflops=455,
        mfu=455 / 989, nic_GBps=H100_NIC, extra=dict(MIXTRAL_EXTRA, ffn=16_384),
        notes="expert tensor parallelism 1 (MoE Parallel Folding: experts whole, the ep group folded into the tp x dp "
              "ranks of one node: Layout.etp = 1); without folding the planner's ep = 8 beside tp = 2 would span two "
              "nodes"),
]


def published_mfu(run: Run) -> float:
    """The paper's MFU, or Megatron's recompute-counted TFLOP/s converted to the model's own FLOPs
    (0.0: no throughput published)."""
    if run.mfu or not run.tflops:
        return run.mfu
    s, h, l, v = run.seq_len, run.shape["d_model"], run.shape["n_layers"], run.shape["vocab_size"]
    ratio = 72 * (1 + s / (6 * h) + v / (12 * l * h)) / (96 * (1 + s / (6 * h) + v / (16 * l * h)))
    return run.tflops * ratio / run.gpu.bf16_TFLOPs


def spec_of(run: Run) -> Any:
    return pl.ModelSpec(**run.shape, name=run.name, **(run.extra if NEW_API else {}))


def cluster_of(run: Run) -> Any:
    if NEW_API:
        return pl.Cluster(run.gpus, run.gpu, nic_GBps=run.nic_GBps)
    return pl.Cluster(run.gpus, run.gpu)


def _key(p: Any) -> tuple:
    if NEW_API:
        return pl.rank_key(p)
    return (not p.fits, round(p.step_s, 3), sum(p.link_bytes().values()), p.memory_bytes)


def _matches(layout: Any, stated: dict) -> bool:
    for k, want in stated.items():
        got = getattr(layout, k, 1 if k == "v" else None)
        if k == "recompute" and not NEW_API:
            want = want == "full"
        if (k == "v" and not NEW_API) or (k == "zero" and want == 0 and not NEW_API):
            continue
        if got != want:
            return False
    return True


def compare(run: Run) -> dict:
    spec, work, cluster = spec_of(run), pl.Workload(run.seq_len, run.global_batch), cluster_of(run)
    mbs = tuple(sorted({1, 2, 4, run.layout.get("micro_batch", 1)}))
    cps = tuple(sorted({1, 2, 4, run.layout.get("cp", 1)}))
    options = dict(run.software, zero_stages=(0, 1, 2, 3)) if NEW_API else {}
    if "v" in run.layout and NEW_API:
        options["virtual_stages"] = tuple(sorted({1, 2, 4, run.layout["v"]}))
    plans = pl.candidates(spec, work, cluster, micro_batches=mbs, cp_sizes=cps, **options)
    same = [p for p in plans if _matches(p.layout, run.layout)]
    if not same:
        raise ValueError(f"{run.name}: the planner offers no layout with {run.layout}")
    pub = same[0]
    rank = plans.index(pub) + 1
    mesh = {k: run.layout[k] for k in ("dp", "tp", "pp", "cp", "ep", "etp") if k in run.layout}
    mesh_rank = next(i for i, p in enumerate(plans, 1) if _matches(p.layout, mesh))
    best = plans[0]
    eff = cluster.efficiency if NEW_API else cluster.mfu
    return dict(run=run, spec=spec, plans=plans, pub=pub, best=best, rank=rank, mesh_rank=mesh_rank,
                ratio=pub.step_s / best.step_s, mfu=pub.mfu, pub_mfu=published_mfu(run),
                implied=eff * published_mfu(run) / pub.mfu if published_mfu(run) else 0.0)


def table(rows: list[dict]) -> str:
    out = ["| run | params | GPUs | published layout (as the planner fills it) | fits | rank | mesh rank | "
           "est. step / best's | MFU est. / published | kernel eff. implied | planner's best |",
           "|---|---:|---:|---|:-:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        versus = (f"{r['mfu']:.2f} / {r['pub_mfu']:.2f} = {r['mfu'] / r['pub_mfu']:.2f} | {r['implied']:.2f}"
                  if r["pub_mfu"] else f"{r['mfu']:.2f} / not published | -")
        out.append(f"| {r['run'].name} | {r['spec'].num_params / 1e9:.0f}B | {r['run'].gpus} | {r['pub'].layout} | "
                   f"{'yes' if r['pub'].fits else 'no'} | {r['rank']} of {len(r['plans'])} | {r['mesh_rank']} | "
                   f"{r['ratio']:.2f} | {versus} | {r['best'].layout} |")
    out.append("")
    out.append("rank: the published layout (fields the paper leaves open filled with the planner's best) among the "
               "planner's candidates; mesh rank: the best candidate with the published dp, tp, pp, cp (and ep). kernel eff. "
               "implied: the kernels' efficiency at which the planner's MFU for the published layout would equal the "
               "published MFU (the planner's own: " + ("the GPU's measured matmul ceiling)." if NEW_API else "0.4)."))
    return "\n".join(out)
