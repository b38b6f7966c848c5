"""Lab 6's graded tasks: wrapping with `fully_shard` on a 1-D and a 2-D (HSDP) mesh, and its cost.

- `wrap`: the learner's `wrap(model, mesh, granularity, reshard_after_forward)`
  on 2 ranks (1-D mesh: per block, whole model, no reshard) and on 4 ranks (a
  2 x 2 mesh: replicate x shard). Three steps of SGD with momentum on the
  'tiny' model; the parameters must equal one process's on the full batch,
  every parameter must be sharded on the mesh it was given, the units must be
  the blocks and the root (or the root alone), the model states must be
  12Ψ/S (fp32 param + grad + momentum over the S ranks of a shard group) and
  the traffic of a step exactly the algorithmic bytes of the closed form;
- `predict_traffic`: the learner's closed form for the bytes one rank sends per
  step, by collective, for any replicate x shard mesh;
- `comm_seconds`: the learner's estimate of a step's communication time on a
  GPU cluster (nominal H100 / A100 figures), FSDP across nodes vs HSDP.

The closed forms below are the reference; `tests/test_ch06_checks.py` shows
they equal what the meter measures on real ranks.
Under `distlab grade` the wrap task's batches are drawn from a secret seed
(`inputs`), and each rank receives only its own shard of each.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

import distlab
from distlab.checks.draws import drawn_batch_shards, full_batches
from distlab.checks.task import Case, Line, check_line, grader, per_ranks, table, task
from distlab.checks.verdict import CheckFailed, compare, expect

# What the lab's answer cells may use: the lab's setup cell holds these lines verbatim.
PRELUDE = """\
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import distlab
from distlab.theory.hardware import A100, H100"""

PRESET, BATCH, STEPS, LR, MOMENTUM = "tiny", 8, 2, 0.5, 0.9
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# (granularity, reshard_after_forward, steps) per launch: a 1-D mesh tries three wrappings, the 2-D mesh one.
# The first of each trains two steps (momentum used); the others one (every step sends the same bytes).
CONFIGS_1D = (("block", None, STEPS), ("model", None, 1), ("block", False, 1))
CONFIGS_2D = (("block", None, STEPS),)


# ---- the closed forms (reference) -----------------------------------------------------------------

def traffic(psi: float, psi_root: float, replicas: int, shard_size: int, bytes_per_element: float = 4,
            reshard_after_forward: bool | None = None) -> dict[str, float]:
    """Algorithmic bytes one rank sends per step with `fully_shard` on a replicas x shard_size mesh.

    Forward all-gathers every unit (Ψ); backward gathers again the units resharded
    after forward (None: all but the root, Ψ - Ψ_root; True: Ψ; False: none).
    The gradients are reduce-scattered in the shard group (Ψ), and each rank's
    shard of them, Ψ/S, is all-reduced across the R replicas.
    """
    b, s, r = bytes_per_element, shard_size, replicas
    regather = {None: psi - psi_root, True: psi, False: 0}[reshard_after_forward]
    return {"all_gather": (psi + regather) * b * (s - 1) / s,
            "reduce_scatter": psi * b * (s - 1) / s,
            "all_reduce": 2 * (psi * b / s) * (r - 1) / r}


def seconds(psi: float, nodes: int, gpu: Any, hsdp: bool) -> float:
    """Communication seconds per step for bf16 traffic, each collective at its slowest link's bandwidth.

    FSDP: one shard group of every GPU; across nodes its rings run at InfiniBand
    speed. HSDP: shard within a node (NVLink), replicate across nodes (InfiniBand).
    """
    per_node = gpu.gpus_per_node
    if hsdp:
        t = traffic(psi, 0, nodes, per_node, 2)
        return (t["all_gather"] + t["reduce_scatter"]) / (gpu.nvlink_GBps * 1e9) + t["all_reduce"] / (gpu.ib_GBps * 1e9)
    t = traffic(psi, 0, 1, nodes * per_node, 2)
    link = gpu.nvlink_GBps if nodes == 1 else gpu.ib_GBps
    return sum(t.values()) / (link * 1e9)


# ---- task 1: wrap -----------------------------------------------------------------------------------

def _mesh(shape: tuple[int, ...]) -> Any:
    return distlab.mesh(*shape, names=("replicate", "shard") if len(shape) == 2 else None)


def _key(gran: str, reshard: Any) -> str:
    return f"{gran}, reshard_after_forward={reshard}"


def _train(model: torch.nn.Module, steps: int, inputs: dict | None = None) -> tuple[Any, Any, dict]:
    """`steps` SGD steps on this rank's slice of each batch (the package's in the notebook, drawn under
    grading: `inputs`): (each step's traffic, model states after the last, full parameters). Every step whose
    parameters are judged is metered, so its traffic is judged too."""
    from distlab.meters import model_state, track_comm
    from distlab.course.models import PRESETS, lm_loss, split_batch, synthetic_batch
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    comm, state = [], None
    for step in range(steps):
        if inputs is None:
            x, y = split_batch(synthetic_batch(step, BATCH, PRESETS[PRESET]), distlab.rank(), distlab.world_size())
        else:
            x, y = inputs[f"x{step}"].to(distlab.device()), inputs[f"y{step}"].to(distlab.device())
        with track_comm() as meter:
            lm_loss(model, x, y).backward()
        opt.step()
        comm.append(meter.stats())
        state = model_state(model, optimizer=opt)
        opt.zero_grad(set_to_none=True)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.named_parameters()}
    return comm, state, full


@functools.lru_cache(maxsize=1)
def _wrap_reference() -> dict:
    """One process on the full batch, SGD with momentum: the parameters after each step. The same for
    every case (and every variant of the task a test builds): computed once per process."""
    return _wrap_on(None)


def _wrap_on(batches: list | None) -> dict:
    """`_wrap_reference` on the package's batches (None) or on given (drawn) whole batches.

    torch.optim.SGD(lr=LR, momentum=MOMENTUM)'s arithmetic written out (buf = g, then buf = m buf + g;
    p -= lr buf): the first torch.optim optimizer imports torch._dynamo, seconds in the notebook's kernel.
    """
    from distlab.course.models import PRESETS, build_model, lm_loss, num_params, synthetic_batch
    model = build_model(PRESET, device="cpu")
    psi = num_params(model)
    psi_root = psi - sum(p.numel() for p in model.blocks.parameters())
    params = list(model.parameters())
    bufs: list = [None] * len(params)
    after = {}
    for step in range(STEPS):
        x, y = synthetic_batch(step, BATCH, PRESETS[PRESET], device="cpu") if batches is None else batches[step]
        lm_loss(model, x, y).backward()
        with torch.no_grad():
            for i, p in enumerate(params):
                bufs[i] = p.grad.clone() if bufs[i] is None else bufs[i].mul_(MOMENTUM).add_(p.grad)
                p.add_(bufs[i], alpha=-LR)
                p.grad = None
        after[step + 1] = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"psi": psi, "psi_root": psi_root, "n_layers": PRESETS[PRESET].n_layers, "params": after}


def wrap_inputs(case: Case, rng: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Under grading: every rank's shard of each step's batch."""
    return drawn_batch_shards(rng, case.world_size, STEPS, BATCH, PRESET)


def wrap_exercise(case: Case, wrap: Any, inputs: dict | None = None) -> dict:
    from torch.distributed.fsdp import FSDPModule

    from distlab.course.models import build_model
    shape = tuple(case.args["shape"])
    out = {}
    for gran, reshard, steps in (CONFIGS_1D if len(shape) == 1 else CONFIGS_2D):
        distlab.engine.runtime.progress(f"wrap(model, mesh {shape}, {gran!r}, reshard_after_forward={reshard})")
        model = build_model(PRESET)
        returned = wrap(model, _mesh(shape), gran, reshard)
        units = sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))
        meshes = sorted({(tuple(p.device_mesh.shape), tuple(p.device_mesh.mesh_dim_names or ()))
                         if hasattr(p, "device_mesh") else ((), ("not sharded",)) for p in model.parameters()})
        comm, state, full = _train(model, steps, inputs)
        out[_key(gran, reshard)] = {"returned_model": returned is model, "units": units,
                                    "meshes": [[list(s), list(n)] for s, n in meshes],
                                    "comm": comm, "state": state, "params": full}
    return out


def wrap_reference(case: Case, inputs: list | None = None) -> dict:
    if inputs is None:
        return _wrap_reference()
    return _wrap_on(full_batches(inputs, STEPS))


def wrap_judge(case: Case, outputs: list, reference: dict) -> list[Line]:
    shape = tuple(case.args["shape"])
    replicas, shard = (1, shape[0]) if len(shape) == 1 else shape
    configs = CONFIGS_1D if len(shape) == 1 else CONFIGS_2D
    psi, psi_root = reference["psi"], reference["psi_root"]
    names = ["replicate", "shard"] if len(shape) == 2 else []

    def units() -> str:
        blocks = sorted([""] + [f"blocks.{i}" for i in range(reference["n_layers"])])
        for r, out in enumerate(outputs):
            for gran, reshard, _ in configs:
                got = out[_key(gran, reshard)]
                if not got["returned_model"]:
                    raise CheckFailed("wrap must return the model it was given (fully_shard changes it in place)")
                want = blocks if gran == "block" else [""]
                if got["units"] != want:
                    raise CheckFailed(f"granularity {gran!r}: FSDP units {got['units'] or 'none'}, expected "
                                      + ("every block and the root ('')" if gran == "block" else "the root ('') only"))
                if got["meshes"] != [[list(shape), names]]:
                    raise CheckFailed(f"rank {r}: parameters live on meshes {got['meshes']}, expected all on the "
                                      f"mesh wrap was given, shape {list(shape)}: pass mesh=mesh to fully_shard")
        return f"{reference['n_layers']} blocks + the root, or the root alone; every parameter on the given mesh"

    def params() -> str:
        for r, out in enumerate(outputs):
            for gran, reshard, steps in configs:
                got, ref = out[_key(gran, reshard)]["params"], reference["params"][steps]
                if sorted(got) != sorted(ref):
                    raise CheckFailed(f"rank {r}: wrap changed the model's parameter names")
                for k, want in ref.items():
                    try:
                        compare(got[k], want, atol=1e-5, rtol=1e-4, what=f"{k}")
                    except CheckFailed as exc:
                        raise CheckFailed(f"rank {r}, {_key(gran, reshard)}, after {steps} step(s): {exc}") from None
        return "every rank matches one process on the full batch, step by step"

    def bytes_line(check_state: bool) -> str:
        for r, out in enumerate(outputs):
            for gran, reshard, steps in configs:
                got = out[_key(gran, reshard)]
                root = psi if gran == "model" else psi_root
                want = traffic(psi, root, replicas, shard, 4, reshard)
                expect(len(got["comm"]) == steps, f"rank {r}, {_key(gran, reshard)}: {len(got['comm'])} "
                       f"metered steps, expected {steps}")
                for k, stats in enumerate(got["comm"]):
                    at, when = f"rank {r}, {_key(gran, reshard)}", f"in step {k}" if steps > 1 else "in a step"
                    sent = stats.bytes
                    for kind in KINDS:
                        if sent.get(kind, 0) != round(want[kind]):
                            raise CheckFailed(f"{at}: {kind} sent {sent.get(kind, 0)} B {when}, expected "
                                              f"{round(want[kind])} B (algorithmic bytes of the closed form)")
                    other = sorted(set(sent) - set(KINDS))
                    if other:
                        raise CheckFailed(f"{at}: unexpected collectives {other} {when}")
                if check_state and got["state"].total != 12 * psi // shard:
                    raise CheckFailed(f"rank {r}: model states {got['state'].total} B after a step, expected "
                                      f"12Ψ/S = {12 * psi // shard} B (fp32 param + grad + momentum, sharded over "
                                      f"the S = {shard} ranks of a shard group)")
        if check_state:
            return "12Ψ/S at rest; all-gather and reduce-scatter in the shard group, all-reduce across replicas"
        return "all-gathers (2Ψ - Ψ_root, Ψ without reshard) and a reduce-scatter (Ψ), x 4 B x (N-1)/N"

    if len(shape) == 1:
        return [check_line(case.lines[0], units), check_line(case.lines[1], params),
                check_line(case.lines[2], lambda: bytes_line(False))]
    def units_and_params() -> str:
        units()
        return params() + ", every parameter sharded on the 2x2 mesh"

    return [check_line(case.lines[0], units_and_params), check_line(case.lines[1], lambda: bytes_line(True))]


# ---- task 2: predict_traffic -------------------------------------------------------------------------

# (psi, psi_root, replicas, shard_size, bytes_per_element): the lab's meshes, then cluster sizes.
TRAFFIC_LAB = ((34_176, 8_768, 1, 2, 4), (34_176, 8_768, 1, 4, 4), (34_176, 8_768, 2, 2, 4),
               (34_176, 8_768, 4, 1, 4), (34_176, 34_176, 1, 2, 4))
TRAFFIC_CLUSTER = ((7.5e9, 0, 1, 64, 2), (7.5e9, 0, 8, 8, 2), (7.5e9, 1e8, 8, 8, 2), (7e10, 2e9, 16, 8, 2),
                   (1e9, 0, 3, 5, 2))


def predict_traffic_exercise(case: Case, predict_traffic: Any) -> dict:
    out = {}
    for cfg in TRAFFIC_LAB + TRAFFIC_CLUSTER:
        distlab.engine.runtime.progress(f"predict_traffic{cfg}")
        got = predict_traffic(*cfg)
        out[str(cfg)] = {k: float(v) for k, v in dict(got).items()}
    return out


def predict_traffic_judge(case: Case, outputs: list, reference: Any) -> list[Line]:
    def line(cfgs: tuple) -> str:
        for cfg in cfgs:
            got, want = outputs[0][str(cfg)], traffic(*cfg)
            for kind in KINDS:
                if kind not in got:
                    raise CheckFailed(f"predict_traffic{cfg} has no {kind!r} entry")
                if not math.isclose(got[kind], want[kind], rel_tol=1e-9, abs_tol=1e-6):
                    psi, root, r, s, b = cfg
                    raise CheckFailed(f"Ψ={psi:g}, Ψ_root={root:g}, R={r}, S={s}, {b:g} B/element: "
                                      f"{kind} {got[kind]:.6g} B, expected {want[kind]:.6g} B")
        return f"exact in {len(cfgs)} cases"
    return [check_line(case.lines[0], lambda: line(TRAFFIC_LAB)), check_line(case.lines[1], lambda: line(TRAFFIC_CLUSTER))]


# ---- task 3: comm_seconds ----------------------------------------------------------------------------

SECONDS_CASES = ((7.5e9, 8, "H100", False), (7.5e9, 8, "H100", True), (7.5e9, 1, "H100", False),
                 (7.5e9, 1, "H100", True), (7e10, 16, "A100", False), (7e10, 16, "A100", True))


def comm_seconds_exercise(case: Case, comm_seconds: Any) -> dict:
    from distlab.theory import hardware
    return {str(c): float(comm_seconds(c[0], c[1], getattr(hardware, c[2]), c[3])) for c in SECONDS_CASES}


def comm_seconds_judge(case: Case, outputs: list, reference: Any) -> list[Line]:
    from distlab.theory import hardware

    def line(cases: tuple) -> str:
        for c in cases:
            got, want = outputs[0][str(c)], seconds(c[0], c[1], getattr(hardware, c[2]), c[3])
            if not math.isclose(got, want, rel_tol=1e-6):
                raise CheckFailed(f"{c[0] / 1e9:g}B params, {c[1]} node(s) of {c[2]}, "
                                  f"{'HSDP' if c[3] else 'FSDP'}: {got:.4g} s, expected {want:.4g} s")
        return f"right in {len(cases)} cases"
    return [check_line(case.lines[0], lambda: line(SECONDS_CASES[:4])), check_line(case.lines[1], lambda: line(SECONDS_CASES[4:]))]


WRAP_HANG_HINT = ("FSDP hangs when ranks disagree: every rank must call fully_shard on the same modules, "
                  "in the same order, with the same mesh and options.")

TASKS = table(
    task("wrap", "wrap",
         per_ranks((2,), "wrap, {n} ranks: units and mesh", "wrap, {n} ranks: parameters", "wrap, {n} ranks: traffic",
                   args={"shape": (2,)})
         + per_ranks((4,), "wrap on a 2x2 mesh (HSDP), {n} ranks: parameters",
                     "wrap on a 2x2 mesh (HSDP), {n} ranks: model states and traffic", args={"shape": (2, 2)}),
         inputs=wrap_inputs, exercise=wrap_exercise, reference=wrap_reference, judge=wrap_judge,
         hang_hint=WRAP_HANG_HINT),
    task("predict_traffic", "predict_traffic",
         per_ranks((1,), "predict_traffic: the lab's meshes (1x2, 1x4, 2x2, 4x1, one unit)",
                   "predict_traffic: cluster meshes (8 nodes x 8 GPUs, 16 x 8, 3 x 5)"),
         exercise=predict_traffic_exercise, judge=predict_traffic_judge),
    task("comm_seconds", "comm_seconds",
         per_ranks((1,), "comm_seconds: 7.5B on H100 nodes, FSDP vs HSDP", "comm_seconds: 70B on 16 A100 nodes"),
         exercise=comm_seconds_exercise, judge=comm_seconds_judge),
)

grade = grader(TASKS)
