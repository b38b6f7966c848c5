"""The memory calculator: model states per device for each ZeRO stage, activations, a TP degree.

    from distlab.viz.widgets import zero_table, markdown_table, memory_calculator
    rows = zero_table(7.5e9, 64)          # the ZeRO paper's example: 120 / 31.4 / 16.6 / 1.9 GB
    print(markdown_table(rows))
    act = Activations().bytes_per_device(tp=1)   # S = 2048, b = 1, h = 4096, 36 layers: 34.4 GB
    memory_calculator()                   # sliders in Jupyter; a static table elsewhere

The arithmetic lives in `distlab.theory` (`theory.tensor_parallel` for activations); this module only
arranges it. `zero_table`, `largest_models` and `Activations` are pure (tested without Jupyter);
`memory_calculator` is the ipywidgets front end over them. With a tensor-parallel degree t,
each device holds 1/t of the weights and the ZeRO stages shard that over the N/t data-parallel
ranks; activations are not sharded by data parallelism at all, only by TP (and SP).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

from distlab.theory import RECIPES, largest_model, zero_memory_per_device
from distlab.theory.tensor_parallel import RECOMPUTE, activation_bytes_per_layer

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


@dataclass(frozen=True)
class Activations:
    """The shape that sets activation memory (Korthikanti et al.'s model, bf16, dropout on).

    Defaults: a 7.5B-class model (12 L h^2 = 7.2B for h = 4096, L = 36) at S = 2048, b = 1.
    """

    seq_len: int = 2048
    micro_batch: int = 1
    d_model: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    sp: bool = False
    recompute: str = "none"

    def bytes_per_device(self, tp: int = 1) -> float:
        """Bytes one device keeps for backward over all layers of one micro-batch."""
        return self.n_layers * activation_bytes_per_layer(
            self.seq_len, self.micro_batch, self.d_model, self.n_heads, t=tp, sp=self.sp, recompute=self.recompute)

    def describe(self) -> str:
        what = f"S = {self.seq_len}, b = {self.micro_batch}, h = {self.d_model}, {self.n_layers} layers, {self.n_heads} heads"
        return what + (", SP" if self.sp else "") + ("" if self.recompute == "none" else f", {self.recompute} recompute")


def tp_table(num_params: float, world_size: int, tp: int = 1, **kwargs: Any) -> list[ZeroRow]:
    """`zero_table` for a tensor-parallel degree `tp`: each device holds Ψ/tp of the weights, and the
    ZeRO stage shards that over the world_size/tp data-parallel ranks."""
    if tp < 1 or world_size % tp:
        raise ValueError(f"the TP degree ({tp}) must divide the number of devices ({world_size})")
    return zero_table(num_params / tp, world_size // tp, **kwargs)


def markdown_table(rows: list[ZeroRow], device_bytes: float | None = None,
                   activation_bytes: float | None = None, simulated: dict[int, float] | None = None) -> str:
    """The rows as a Markdown table in GB; with `device_bytes`, also the largest model per stage;
    with `activation_bytes` (the same for every stage), also activations and the total; with
    `simulated` ({stage: model-state bytes measured by `distlab simulate` at the same Ψ and N}), a column
    that marks which cells were simulated (the others say "formula only")."""
    r0 = rows[0]
    fit = largest_models(device_bytes, r0.world_size, k=r0.k, recipe=r0.recipe) if device_bytes else None
    head = "| stage | params (GB) | grads (GB) | optimizer (GB) | per device (GB) |"
    rule = "|---|---:|---:|---:|---:|"
    if activation_bytes is not None:
        head += " activations (GB) | total (GB) |"
        rule += "---:|---:|"
    if fit:
        head += f" largest model in {device_bytes / GB:g} GB |"
        rule += "---:|"
    if simulated:
        head += " simulated (GB) |"
        rule += "---:|"
    lines = [head, rule]
    for r in rows:
        line = (f"| {r.name} | {_gb(r.params_bytes)} | {_gb(r.grads_bytes)} | "
                f"{_gb(r.optimizer_bytes)} | **{_gb(r.bytes_per_device)}** |")
        if activation_bytes is not None:
            line += f" {_gb(activation_bytes)} | **{_gb(r.bytes_per_device + activation_bytes)}** |"
        if fit:
            line += f" {_human(fit[r.stage])} |"
        if simulated:
            line += (f" {_gb(simulated[r.stage])} (simulated) |" if r.stage in simulated else " formula only |")
        lines.append(line)
    return "\n".join(lines)


def bars(rows: list[ZeroRow], device_bytes: float | None = None, activation_bytes: float | None = None,
         tp: int = 1):
    """Stacked bars per stage (params, grads, optimizer state, activations), GB per device."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    names = [r.name for r in rows]
    bottom = [0.0] * len(rows)
    parts = [("params", "params_bytes", "#4C72B0"), ("grads", "grads_bytes", "#DD8452"),
             ("optimizer state", "optimizer_bytes", "#55A868")]
    for label, attr, color in parts:
        vals = [getattr(r, attr) / GB for r in rows]
        ax.bar(names, vals, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if activation_bytes:
        ax.bar(names, [activation_bytes / GB] * len(rows), bottom=bottom, color="#C44E52", label="activations")
        bottom = [b + activation_bytes / GB for b in bottom]
    for i in range(len(rows)):
        ax.text(i, bottom[i], f"{bottom[i]:.1f}" if bottom[i] >= 1 else f"{bottom[i]:.3g}", ha="center",
                va="bottom", fontsize=8)
    if device_bytes:
        ax.axhline(device_bytes / GB, color="black", ls="--", lw=1, label=f"device: {device_bytes / GB:g} GB")
    r0 = rows[0]
    ax.set_ylabel("GB per device")
    tp_text = f", TP t = {tp}" if tp > 1 else ""
    ax.set_title(f"Per device: Ψ = {_human(r0.num_params * tp)}, N = {r0.world_size * tp}{tp_text} (theory)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _fit_line(device_bytes: float, world_size: int, k: float, recipe: str, tp: int = 1,
              activation_bytes: float = 0.0) -> str:
    room = device_bytes - activation_bytes
    if room <= 0:
        return (f"The activations alone ({_gb(activation_bytes)} GB) exceed {device_bytes / GB:g} GB: "
                "raise t, turn on SP or recomputation, or shorten the micro-batch.")
    fit = largest_models(room, world_size // tp, k=k, recipe=recipe)
    parts = ", ".join(f"{STAGE_NAMES[s]} {_human(v * tp)}" for s, v in fit.items())
    after = f" after {_gb(activation_bytes)} GB of activations" if activation_bytes else ""
    return f"Largest model whose states fit in {device_bytes / GB:g} GB{after} on each of {world_size} devices: {parts}."


# ---- the widget ---------------------------------------------------------------------------------

def _psi_options(extra: float) -> list[tuple[str, float]]:
    """Parameter counts the slider offers: 1M to 2T in steps a reader knows (1.3B, 7.5B, 70B, 175B...),
    plus `extra`, so the default is always exactly one of the steps."""
    values = {m * 10 ** e for e in range(6, 13) for m in (1, 1.3, 1.5, 2, 3, 4, 5, 6.7, 7, 7.5)}
    values = {float(f"{v:.3g}") for v in values if v <= 2e12} | {float(extra)}
    return [(_human(v), v) for v in sorted(values)]


SEQ_OPTIONS = [2 ** k for k in range(8, 18)]
HIDDEN_OPTIONS = [512, 768, 1024, 2048, 2560, 4096, 5120, 6144, 8192, 12288, 16384]
HEAD_OPTIONS = [4, 8, 12, 16, 20, 24, 32, 40, 48, 64, 96, 128]


def _with(options: list, value: Any) -> list:
    return sorted(set(options) | {value})


def memory_calculator(num_params: float = DEFAULT_PARAMS, world_size: int = DEFAULT_WORLD_SIZE, *,
                      recipe: str = "mixed", k: float | None = None, device_gb: float = 80.0, tp: int = 1,
                      activations: Activations | None = Activations(),
                      simulated: dict[tuple[float, int], dict[int, float]] | None = None) -> Any:
    """Sliders for Ψ, N, TP degree, K, precision, device memory and the activation shape -> bars, a table,
    and the largest model per stage. `activations=None` leaves activations out. `simulated` maps
    (Ψ, N) to {stage: model-state bytes measured by a fake run (`distlab.course.sim`)}: at those settings
    (mixed precision, K = 12, t = 1) the table gains a column marking the simulated cells.

    Returns the ipywidgets container; display it in Jupyter. It draws at once, into an Output widget;
    where no widget can render (a notebook opened before running, GitHub) its text and HTML show
    the same table for the default values.
    """
    import ipywidgets as w

    default_k = _bytes(recipe, k)[2]
    act = activations or Activations()
    c = {
        "params": w.SelectionSlider(options=_psi_options(num_params), value=float(num_params), description="params Ψ"),
        "devices": w.IntSlider(value=world_size, min=1, max=1024, description="devices N"),
        "tp": w.Dropdown(options=_with([1, 2, 4, 8], tp), value=tp, description="TP degree t"),
        "k": w.FloatSlider(value=default_k, min=0, max=16, step=1, description="K (B/param)"),
        "recipe": w.Dropdown(options=sorted(RECIPES), value=recipe, description="precision"),
        "device_gb": w.FloatSlider(value=device_gb, min=8, max=192, step=8, description="device GB"),
        "activations": w.Checkbox(value=activations is not None, description="count activations"),
        "seq": w.SelectionSlider(options=_with(SEQ_OPTIONS, act.seq_len), value=act.seq_len, description="sequence S"),
        "batch": w.IntSlider(value=act.micro_batch, min=1, max=64, description="micro-batch b"),
        "hidden": w.SelectionSlider(options=_with(HIDDEN_OPTIONS, act.d_model), value=act.d_model, description="hidden h"),
        "layers": w.IntSlider(value=act.n_layers, min=1, max=160, description="layers L"),
        "heads": w.SelectionSlider(options=_with(HEAD_OPTIONS, act.n_heads), value=act.n_heads, description="heads a"),
        "recompute": w.Dropdown(options=list(RECOMPUTE), value=act.recompute, description="recompute"),
        "sp": w.Checkbox(value=act.sp, description="sequence parallel"),
    }
    box = MemoryCalculator(c)
    box.simulated = dict(simulated or {})
    box.children = [w.HBox([c["params"], c["devices"], c["tp"]]), w.HBox([c["k"], c["recipe"], c["device_gb"]]),
                    w.HBox([c["activations"], c["seq"], c["batch"], c["recompute"]]),
                    w.HBox([c["hidden"], c["layers"], c["heads"], c["sp"]]), box.out]
    c["recipe"].observe(lambda ch: setattr(c["k"], "value", RECIPES[ch["new"]].optimizer_bytes), names="value")
    for control in c.values():
        control.observe(box.redraw, names="value")
    box.redraw()
    return box


def _md_to_html(md: str) -> str:
    """The calculator's Markdown (tables, paragraphs, **bold**) as HTML, for viewers without Markdown output."""
    import html
    import re
    out, table = [], []

    def cells(line: str, tag: str) -> str:
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        return "<tr>" + "".join(f"<{tag}>{p}</{tag}>" for p in parts) + "</tr>"

    for block in md.split("\n\n"):
        lines = block.splitlines()
        if lines and lines[0].startswith("|"):
            rows = [cells(lines[0], "th")] + [cells(l, "td") for l in lines[2:]]
            table.append("<table>" + "".join(rows) + "</table>")
            out.append(table.pop())
        else:
            out.append(f"<p>{html.escape(block)}</p>")
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", "\n".join(out))


@functools.lru_cache(maxsize=1)
def _calculator_class() -> type:
    import ipywidgets as w

    class _MemoryCalculator(w.VBox):
        """The calculator's container: its controls by name, its figures, and a static fallback."""

        def __init__(self, controls: dict[str, Any]) -> None:
            super().__init__()
            self.controls, self.out = controls, w.Output()
            self.simulated: dict[tuple[float, int], dict[int, float]] = {}

        def simulated_here(self) -> dict[int, float] | None:
            """The simulated cells for the current settings (the recipe the simulation ran), or None."""
            c = self.controls
            if c["tp"].value != 1 or c["recipe"].value != "mixed" or c["k"].value != 12:
                return None
            return self.simulated.get((float(c["params"].value), int(c["devices"].value)))

        def state(self) -> tuple[list[ZeroRow], float | None, float, int, str]:
            c = self.controls
            tp = c["tp"].value
            rows = tp_table(c["params"].value, c["devices"].value, tp, k=c["k"].value, recipe=c["recipe"].value)
            act = None
            if c["activations"].value:
                act = Activations(c["seq"].value, c["batch"].value, c["hidden"].value, c["layers"].value,
                                  c["heads"].value, c["sp"].value, c["recompute"].value)
            return rows, act.bytes_per_device(tp) if act else None, c["device_gb"].value * GB, tp, \
                act.describe() if act else ""

        def text(self) -> tuple[str, str]:
            """(Markdown table + notes, one line of plain text) for the current values."""
            c = self.controls
            try:
                rows, act, dev, tp, what = self.state()
            except ValueError as exc:
                return str(exc), str(exc)
            sim = self.simulated_here()
            md = markdown_table(rows, activation_bytes=act, simulated=sim)
            if sim:
                md += ("\n\nThe simulated column was measured by running the strategies' code as rank 0 of "
                       f"{c['devices'].value} on fake tensors (`distlab simulate`); the other columns are formulas.")
            md += "\n\n" + _fit_line(dev, c["devices"].value, c["k"].value, c["recipe"].value, tp, act or 0.0)
            if act is not None:
                md += f"\n\nActivations ({what}, bf16, dropout): the same under every ZeRO stage."
            states = ", ".join(f"{r.name} {_gb(r.bytes_per_device)} GB" for r in rows)
            plain = (f"Memory calculator (run the cell for the sliders). Ψ = {_human(c['params'].value)}, "
                     f"N = {c['devices'].value}, t = {tp}: model states per device {states}"
                     + (f"; activations {_gb(act)} GB ({what})" if act is not None else "") + ".")
            return md, plain

        def redraw(self, *_: Any) -> None:
            import matplotlib.pyplot as plt
            from IPython.display import Markdown, display
            md, _ = self.text()
            self.out.clear_output(wait=True)
            with self.out:
                try:
                    rows, act, dev, tp, _ = self.state()
                except ValueError:
                    display(Markdown(md))
                    return
                fig = bars(rows, dev, act, tp)
                plt.show()
                plt.close(fig)
                display(Markdown(md))

        def _repr_mimebundle_(self, **kwargs: Any) -> dict:
            data = super()._repr_mimebundle_(**kwargs)
            md, plain = self.text()
            data["text/plain"] = plain
            data["text/markdown"] = md
            data["text/html"] = _md_to_html(md)
            return data

    return _MemoryCalculator


def MemoryCalculator(controls: dict[str, Any]) -> Any:  # noqa: N802 - builds the class lazily (ipywidgets is optional)
    return _calculator_class()(controls)
