"""Chapter 8's measurement harness, by section (this module only gathers the names for older imports):

- `runner`: the hand-written `PipelineRunner`'s correctness check, timed sweeps, the bubble and one hop read
  off the timelines, the schedule model (sections 3-5);
- `pipelining`: timing `torch.distributed.pipelining`'s stages and reading its tables (section 7);
- `offloaded`: the offloaded optimizer's meters (section 8);
- `mesh3d`: Megatron's blocks for a (pp, dp, tp) mesh and the 3-D run's one-process reference (section 9);
- `calibration`: the lab solution's finer model of the runner's bubble (`runner_message_costs`).

The lecture writes the distributed code itself (the schedules, the runner, PyTorch's stages and schedules,
the offloaded optimizer, FSDP2's offload, the 3-D composition); these modules build stages, meter and read.
"""
from __future__ import annotations

from distlab.course.pipeline.calibration import runner_message_costs
from distlab.course.pipeline.mesh3d import reference_bf16
from distlab.course.pipeline.offloaded import copies_inside, offload_demo
from distlab.course.pipeline.pipelining import run_steps, timed, torch_order
from distlab.course.pipeline.runner import (Schedule, bubble_of, check_pipeline, hop_of, pipeline_runner,
                                            predicted_bubble, stage_compute_s, step_bubbles, sweep, timing_of)

__all__ = ["Schedule", "bubble_of", "check_pipeline", "copies_inside", "hop_of", "offload_demo", "pipeline_runner",
           "predicted_bubble", "reference_bf16", "run_steps", "runner_message_costs", "stage_compute_s",
           "step_bubbles", "sweep", "timed", "timing_of", "torch_order"]
