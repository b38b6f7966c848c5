"""pyproject.toml and environment.yml name the same dependencies; the CLI answers."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pip_section_of_environment_yml() -> set[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip() == "- pip:")
    out = set()
    for line in lines[start + 1:]:
        m = re.match(r"^\s+- (.+)$", line)
        if not m:
            break
        out.add(m.group(1).strip())
    return out


def test_environment_yml_mirrors_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]) | set(project["optional-dependencies"]["dev"]) | {"-e ."}
    # torch is pinned there as the README's pip route pins it; everything else is the same.
    wanted = (wanted - {"torch>=2.10"}) | {"torch==2.13.0"}
    assert _pip_section_of_environment_yml() == wanted
    assert "python=3.11" in (ROOT / "environment.yml").read_text()


def test_torch_floor_is_2_10():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch>=2.10" in deps


# The CLI's commands run in this process (main(argv), as the `distlab` script calls it): a subprocess would
# only add an interpreter importing torch again. The README's commands run as processes in .ci/run.

def test_doctor_reports_and_runs(capsys, no_orphans):
    from distlab.apps.cli import main
    rc = main(["doctor", "--run"])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert "gloo: world sizes 1.." in out.out
    assert "gloo x2: all-reduce ok; memory meter 4194304 B for a 4194304 B tensor" in out.out
    assert out.out.strip().endswith("healthy")
    # chapter 7's DTensor facts, measured on 4 gloo ranks: each layout change runs the collective theory says
    assert ("works  DTensor redistribute (all-gather, all-reduce, reduce-scatter, all-to-all): Shard->Replicate "
            "all_gather; Partial->Replicate all_reduce; Partial->Shard reduce_scatter") in out.out
    assert "works  FSDP2 x TP on a 2 x 2 mesh: max |Δ| vs one process" in out.out


def test_labs_check_cli_agrees_with_the_tree(capsys):
    from distlab.apps.cli import main
    rc = main(["build-labs", "--check", "--root", str(ROOT)])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [blocks[0].strip(), blocks[1].strip()]


def test_ci_runs_exactly_the_readme_commands():
    ci = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()]
    setup, tests = _readme_commands()
    assert "distlab tour" in setup and "pip install torch==2.13.0" in setup
    assert "pytest" in tests
    assert setup in ci and tests in ci


def test_suite_time_selects_the_chapters_asked_for():
    """tools/suite_time.py --chapters 0-6 leaves out every later chapter (files and labs) and the cluster path."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("suite_time", ROOT / "tools" / "suite_time.py")
    suite_time = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite_time)
    assert suite_time.selection(None) == []
    args = suite_time.selection(6)
    ignored = {args[i + 1] for i, a in enumerate(args) if a == "--ignore"}
    def after(n: int) -> set[str]:
        files = [*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("solutions/*.ipynb"), *ROOT.glob("tests/test_ch*.py")]
        return {str(p.relative_to(ROOT)) for p in files if (suite_time._chapter(p.name) or 0) > n}
    later = after(6)
    assert {"notebooks/07_tensor_parallel_lecture.ipynb", "solutions/08_pipeline.ipynb"} <= later
    assert ignored == later | {"tests/test_cluster.py"}
    labs = sorted(p.stem for p in ROOT.glob("labs/*.ipynb") if int(p.name[:2]) > 6)
    assert "07_tensor_parallel" in labs and args[args.index("-k") + 1] == " and ".join(f"not {s}" for s in labs)
    args8 = suite_time.selection(8)
    assert {args8[i + 1] for i, a in enumerate(args8) if a == "--ignore"} == after(8) | {"tests/test_cluster.py"}


def test_every_notebook_names_its_kernel_as_jupyterlab_saves_it():
    """Opening a notebook in JupyterLab and saving it must not change it: its kernelspec is the installed
    ipykernel's own (issue 34: "Python 3" became "Python 3 (ipykernel)" in every file a learner opened)."""
    import json

    from jupyter_client.kernelspec import KernelSpecManager
    spec = KernelSpecManager().get_kernel_spec("python3")
    want = {"display_name": spec.display_name, "language": spec.language, "name": "python3"}
    paths = [p for d in ("notebooks", "labs", "solutions") for p in sorted((ROOT / d).glob("*.ipynb"))]
    assert len(paths) >= 31
    wrong = [p.name for p in paths if json.loads(p.read_text())["metadata"].get("kernelspec") != want]
    assert not wrong, f"kernelspec is not {want} in {wrong}"
