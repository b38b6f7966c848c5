"""`distlab train`: clear errors for a bad strategy, world size or foreign checkpoint; a short run writes its
checkpoints, loss.json and loss.png, and a foreign --resume is refused."""
from __future__ import annotations

import json

import pytest

from distlab.apps.cli import main

SMALL = ["--preset", "tiny", "--max-bytes", "200000", "--ckpt-every", "2", "--eval-every", "2"]


@pytest.mark.parametrize("argv, words", [
    (["--strategy", "zero9"], "unknown strategy 'zero9'"),
    (["--strategy", "single", "--world-size", "2"], "one process"),
    (["--strategy", "ddp", "--world-size", "3"], "does not split over 3 ranks"),
    (["--strategy", "pp", "--world-size", "3"], "3 ranks would leave 1 stage(s) without a block"),
    (["--strategy", "pp", "--world-size", "2", "--accumulate", "1"], "needs at least 2 micro-batches per step"),
    (["--strategy", "ddp", "--world-size", "2", "--resume"], "no complete checkpoint"),
])
def test_bad_arguments_get_a_clear_error(tmp_path, capsys, argv, words):
    assert main(["train", *argv, "--out", str(tmp_path), *SMALL]) == 2
    assert words in capsys.readouterr().err


def test_a_run_writes_checkpoints_and_curves_and_refuses_a_foreign_resume(tmp_path, capsys, no_orphans):
    assert main(["train", "--steps", "2", "--out", str(tmp_path), *SMALL]) == 0
    assert (tmp_path / "checkpoints" / "step_000002").is_dir() and (tmp_path / "loss.png").stat().st_size > 0
    run = json.loads((tmp_path / "loss.json").read_text())
    assert run["steps"] == [0, 1] and run["resumed_from"] is None and len(run["val"]) == 1
    # (resuming itself, at another world size too: tests/test_ch09_training.py)
    assert main(["train", "--steps", "6", "--out", str(tmp_path), "--resume", *SMALL[:1], "small",
                 *SMALL[2:]]) == 2
    assert "another shape" in capsys.readouterr().err


def test_the_tour_draws_lecture_9s_curves(tmp_path):
    from distlab.apps.tour import TOUR_NOTEBOOKS, _figures
    assert "notebooks/09_training_lecture.ipynb" in TOUR_NOTEBOOKS and "solutions/09_training.ipynb" in TOUR_NOTEBOOKS
    rec = {"name": "curves", "world_size": 2, "single": {"steps": [0, 1, 2], "loss": [5.0, 4.0, 3.0], "val": []},
           "strategies": {"ddp": {"loss": [5.0, 4.0, 3.0], "max_abs_dloss": 0.0, "tokens_per_s_ratio": 0.5}}}
    assert _figures({"training": [rec]}, tmp_path) == ["training_curves.png"]
    assert (tmp_path / "training_curves.png").stat().st_size > 0


@pytest.mark.parametrize("argv, micro_batches", [(["--strategy", "pp"], 4), (["--strategy", "pp", "--accumulate", "2"], 2),
                                                 (["--strategy", "ddp"], 1)])
def test_pp_defaults_to_micro_batches_that_fill_a_pipeline(argv, micro_batches):
    # a pipeline of one micro-batch has no overlap; the default does not follow the world size, so a resume on
    # another number of stages keeps the same micro-batches (and the same curve)
    import argparse
    from distlab.apps import train
    sub = argparse.ArgumentParser().add_subparsers()
    train.add_parser(sub)
    args = sub.choices["train"].parse_args([*argv, "--world-size", "2", "--out", "x"])
    assert train.config(args).accumulate == micro_batches
