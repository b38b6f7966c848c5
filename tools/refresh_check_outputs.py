"""Rewrite solution notebooks' committed check-cell outputs in the format `grade` prints now
(`distlab.checks.show.verdict_text`: the verdict table, then the lines), from the verdict lines they hold,
without running anything. Then `distlab build-labs --force`.

    .venv/bin/python tools/refresh_check_outputs.py 09_training 10_moe     # default: every lab in LABS
"""
import re, sys
from pathlib import Path
import nbformat
from distlab.checks import lab_module, LABS
from distlab.checks.labs import is_check_cell, verdict_lines
from distlab.checks.show import verdict_text
from distlab.checks.task import Line

for lab in sys.argv[1:] or LABS:
    path = Path("solutions") / f"{lab}.ipynb"
    nb = nbformat.read(path, as_version=4)
    mod = lab_module(lab)
    changed = 0
    for cell in nb.cells:
        if cell.cell_type != "code" or not is_check_cell(cell):
            continue
        names = re.findall(r'grade\(\s*"([^"]+)"', cell.source)
        if len(names) != 1:
            print(lab, "cell without one grade call:", cell.source[:80]); continue
        task = mod.TASKS[names[0]]
        old = verdict_lines(cell)
        lines = []
        for n, text in zip(task.lines(), old):
            ok = text.startswith("PASS ")
            assert text[5:] == n or text[5:].startswith(n + ": "), (lab, n, text)
            lines.append(Line(n, ok, text[5 + len(n) + 2:] if text[5:] != n else ""))
        assert len(lines) == len(task.lines()) == len(old), (lab, names)
        new = "\n".join(verdict_text(task, lines)) + "\n"
        outs = [o for o in cell.outputs if o.get("output_type") == "stream" and o.get("name") == "stdout"]
        others = [o for o in cell.outputs if o not in outs]
        if others: print(lab, names[0], "other outputs:", [o.get("output_type") + ":" + o.get("name", "") for o in others])
        if "".join(o["text"] for o in outs) != new:
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=new)] + others
            changed += 1
    if changed:
        nbformat.write(nb, path)
    print(lab, "check cells changed:", changed)
