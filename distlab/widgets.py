"""The ZeRO memory calculator: model-state bytes per device for each stage, as a table and a widget.

    from distlab.widgets import zero_table, markdown_table, memory_calculator
    rows = zero_table(7.5e9, 64)          # the ZeRO paper's example: 120 / 31.4 / 16.6 / 1.9 GB
    print(markdown_table(rows))
    memory_calculator()                   # sliders in Jupyter; a static table elsewhere

The arithmetic lives in `distlab.theory`; this module only arranges it. `zero_table` and
`largest_models` are pure functions (tested without Jupyter); `memory_calculator` is the
ipywidgets front end over them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from distlab.theory import RECIPES, largest_model, zero_memory_per_device

GB = 1e9
STAGE_NAMES = {0: "DDP (stage 0)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 / FSDP"}
DEFAULT_PARAMS = 7.5e9
DEFAULT_WORLD_SIZE = 64


@dataclass(frozen=True)
class ZeroRow:
    """Bytes one device holds for its model states at one ZeRO stage."""

    stage: int
    name: str
    num_params: float
    world_size: int
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    recipe: str = "mixed"
    k: float = 12

    @property
    def bytes_per_device(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    def as_record(self) -> dict[str, Any]:
        """Fields for `distlab.record("zero_table", **row.as_record())`."""
        return {**asdict(self), "bytes_per_device": self.bytes_per_device}


def _bytes(recipe: str, k: float | None) -> tuple[float, float, float]:
    if recipe not in RECIPES:
        raise ValueError(f"unknown precision recipe {recipe!r}; choose one of {sorted(RECIPES)}")
    r = RECIPES[recipe]
    return r.param_bytes, r.grad_bytes, r.optimizer_bytes if k is None else k


def zero_table(num_params: float = DEFAULT_PARAMS, world_size: int = DEFAULT_WORLD_SIZE, *,
               k: float | None = None, recipe: str = "mixed",
               stages: tuple[int, ...] = (0, 1, 2, 3)) -> list[ZeroRow]:
    """One row per stage: what each of `world_size` devices holds for a `num_params` model.

    `recipe` gives bytes per parameter for weights and gradients ("mixed": 2 + 2, "fp32": 4 + 4);
    `k` overrides its optimizer bytes per parameter (mixed Adam: 12, fp32 Adam: 8).
    Stage 1 shards the optimizer state, 2 also the gradients, 3 also the weights.
    """
    p, g, o = _bytes(recipe, k)
    rows = []
    for stage in stages:
        total = zero_memory_per_device(num_params, world_size, stage, k=o, param_bytes=p, grad_bytes=g)
        n = world_size
        params = p * num_params / (n if stage >= 3 else 1)
        grads = g * num_params / (n if stage >= 2 else 1)
        opt = o * num_params / (n if stage >= 1 else 1)
        assert abs(params + grads + opt - total) <= 1e-6 * max(total, 1)
        rows.append(ZeroRow(stage, STAGE_NAMES[stage], num_params, world_size, params, grads, opt, recipe, o))
    return rows


def largest_models(device_bytes: float, world_size: int, *, k: float | None = None,
                   recipe: str = "mixed", stages: tuple[int, ...] = (0, 1, 2, 3)) -> dict[int, float]:
    """Stage -> the largest Ψ whose model states fit in `device_bytes` (activations not counted)."""
    if device_bytes <= 0:
        raise ValueError(f"device memory must be positive, got {device_bytes} bytes")
    p, g, o = _bytes(recipe, k)
    return {s: largest_model(device_bytes, world_size, s, k=o, param_bytes=p, grad_bytes=g) for s in stages}


def _human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def _gb(nbytes: float) -> str:
    """GB with one decimal (the ZeRO paper's 120 / 31.4 / 16.6 / 1.9), 3 digits below 1 GB."""
    x = nbytes / GB
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def markdown_table(rows: list[ZeroRow], device_bytes: float | None = None) -> str:
    """The rows as a Markdown table in GB; with `device_bytes`, also the largest model per stage."""
    r0 = rows[0]
    fit = largest_models(device_bytes, r0.world_size, k=r0.k, recipe=r0.recipe) if device_bytes else None
    head = "| stage | params (GB) | grads (GB) | optimizer (GB) | per device (GB) |"
    rule = "|---|---:|---:|---:|---:|"
    if fit:
        head += f" largest model in {device_bytes / GB:g} GB |"
        rule += "---:|"
    lines = [head, rule]
    for r in rows:
        line = (f"| {r.name} | {_gb(r.params_bytes)} | {_gb(r.grads_bytes)} | "
                f"{_gb(r.optimizer_bytes)} | **{_gb(r.bytes_per_device)}** |")
        if fit:
            line += f" {_human(fit[r.stage])} |"
        lines.append(line)
    return "\n".join(lines)


def bars(rows: list[ZeroRow], device_bytes: float | None = None):
    """Stacked bars per stage (params, grads, optimizer state), GB per device."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    names = [r.name for r in rows]
    bottom = [0.0] * len(rows)
    for label, attr, color in (("params", "params_bytes", "#4C72B0"), ("grads", "grads_bytes", "#DD8452"),
                               ("optimizer state", "optimizer_bytes", "#55A868")):
        vals = [getattr(r, attr) / GB for r in rows]
        ax.bar(names, vals, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        ax.text(i, bottom[i], _gb(r.bytes_per_device), ha="center", va="bottom", fontsize=8)
    if device_bytes:
        ax.axhline(device_bytes / GB, color="black", ls="--", lw=1, label=f"device: {device_bytes / GB:g} GB")
    r0 = rows[0]
    ax.set_ylabel("GB per device")
    ax.set_title(f"Model states per device: Ψ = {_human(r0.num_params)}, N = {r0.world_size} (theory)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def memory_calculator(num_params: float = DEFAULT_PARAMS, world_size: int = DEFAULT_WORLD_SIZE, *,
                      recipe: str = "mixed", k: float | None = None, device_gb: float = 80.0) -> Any:
    """Sliders for Ψ, N, K, precision recipe and device memory -> bars, table, largest model per stage.

    Returns the ipywidgets container; display it in Jupyter. Its first drawing happens at once,
    into an Output widget, so a static run (nbval, nbconvert) records a widget view and no error.
    """
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import Markdown, display

    default_k = _bytes(recipe, k)[2]
    psi = w.FloatLogSlider(value=num_params, base=10, min=6, max=12.5, step=0.05, description="params Ψ",
                           readout_format=".3g")
    n = w.IntSlider(value=world_size, min=1, max=1024, description="devices N")
    kk = w.FloatSlider(value=default_k, min=0, max=16, step=1, description="K (B/param)")
    rec = w.Dropdown(options=sorted(RECIPES), value=recipe, description="precision")
    dev = w.FloatSlider(value=device_gb, min=8, max=192, step=8, description="device GB")
    out = w.Output()

    def on_recipe(change: dict) -> None:
        kk.value = RECIPES[change["new"]].optimizer_bytes

    def redraw(*_: Any) -> None:
        rows = zero_table(psi.value, n.value, k=kk.value, recipe=rec.value)
        out.clear_output(wait=True)
        with out:
            fig = bars(rows, dev.value * GB)
            plt.show()
            plt.close(fig)
            display(Markdown(markdown_table(rows) + "\n\n" + _fit_line(dev.value * GB, n.value, kk.value, rec.value)))

    rec.observe(on_recipe, names="value")
    for control in (psi, n, kk, rec, dev):
        control.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([psi, n]), w.HBox([kk, rec, dev]), out])


def _fit_line(device_bytes: float, world_size: int, k: float, recipe: str) -> str:
    fit = largest_models(device_bytes, world_size, k=k, recipe=recipe)
    parts = ", ".join(f"{STAGE_NAMES[s]} {_human(v)}" for s, v in fit.items())
    return f"Largest model whose states fit in {device_bytes / GB:g} GB on each of {world_size} devices: {parts}."
