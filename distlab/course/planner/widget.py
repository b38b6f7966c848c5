"""The planner as a widget: sliders in, the ranked layouts and their assumptions out."""
from __future__ import annotations

from typing import Any

from distlab.course.planner.layout import Cluster, Workload
from distlab.course.planner.rank import candidates, markdown
from distlab.course.planner.shapes import ModelSpec, recipe
from distlab.theory.hardware import A100, H100

GPUS = {"H100 (NVLink 4, NDR IB)": H100, "A100 (NVLink 3, HDR IB)": A100}
FAMILIES = {"GPT (MHA, GeLU MLP 4d)": "gpt", "Llama (GQA, SwiGLU)": "llama",
            "Mixtral (8 experts, top-2)": "mixtral"}


def planner(num_params: float = 70e9, gpus: int = 256, *, seq_len: int = 4096, global_batch: int = 1024,
            top: int = 8) -> Any:
    """Sliders for model size and shape, sequence, batch, GPU kind, memory and count -> the ranked layouts.

    Returns the ipywidgets container (its first drawing happens at once, so a static run
    records a widget view and no error).
    """
    import ipywidgets as w
    from IPython.display import Markdown, display

    size = w.FloatLogSlider(value=num_params, base=10, min=8, max=12.3, step=0.05, description="params Ψ",
                            readout_format=".3g")
    n = w.IntSlider(value=gpus, min=8, max=4096, step=8, description="GPUs")
    seq = w.Dropdown(options=[1024, 2048, 4096, 8192, 16384, 32768], value=seq_len, description="sequence")
    batch = w.IntSlider(value=global_batch, min=8, max=8192, step=8, description="global batch")
    kind = w.Dropdown(options=list(GPUS), value=next(iter(GPUS)), description="GPU")
    mem = w.FloatSlider(value=80, min=16, max=192, step=8, description="GPU GB")
    family = w.Dropdown(options=list(FAMILIES), value=next(iter(FAMILIES)), description="shape")
    out = w.Output()

    def redraw(*_: Any) -> None:
        spec = ModelSpec.from_size(size.value, family=FAMILIES[family.value])
        cluster = Cluster(n.value, GPUS[kind.value], mem.value)
        plans = candidates(spec, Workload(seq.value, batch.value), cluster)
        out.clear_output(wait=True)
        with out:
            active = f", {spec.active_params / 1e9:.1f}B active" if spec.moe else ""
            head = (f"**{spec.num_params / 1e9:.1f}B parameters**{active} ({spec.n_layers} layers, d = {spec.d_model}) "
                    f"on {n.value} x {cluster.gpu.name}, {mem.value:g} GB each. "
                    f"Seeds' recipe: *{recipe(spec.num_params, gpus=n.value)}*.")
            if not plans:
                display(Markdown(head + "\n\nNo layout: the global batch does not split over these GPUs."))
                return
            display(Markdown(head + "\n\n" + markdown(plans[:top], cluster)))

    for control in (size, n, seq, batch, kind, mem, family):
        control.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([size, n]), w.HBox([seq, batch]), w.HBox([kind, mem]), family, out])
