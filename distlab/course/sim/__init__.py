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

Modules: world (the fake world), step (a strategy's step, measured on any rank), run (`simulate` and its
table), plans (chapter 8's planner against simulation).
"""
from distlab.course.sim.plans import PlanCheck, check_plan, check_recipes, recipe_layouts
from distlab.course.sim.run import SimResult, describe, markdown, simulate, simulate_table
from distlab.course.sim.step import (LAB_CLASS, LR, STAGE, STRATEGIES, Built, StepBytes, bf16_model, build,
                                     measure_step, measure_steps, scale_config)
from distlab.course.sim.world import compute_like_a_gpu, device_mesh, fake_ddp_hook, fake_world

__all__ = ["PlanCheck", "check_plan", "check_recipes", "recipe_layouts", "SimResult", "describe", "markdown",
           "simulate", "simulate_table", "LAB_CLASS", "LR", "STAGE", "STRATEGIES", "Built", "StepBytes",
           "bf16_model", "build", "measure_step", "measure_steps", "scale_config", "compute_like_a_gpu",
           "device_mesh", "fake_ddp_hook", "fake_world"]
