"""The launcher's command line, without a cluster: where the job's logs go by default, and the ray mode where
Ray is not installed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from launcher.cli import build_parser, default_folder

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("target", [["--target_dir", "{t}"], ["--target-dir={t}"]])
def test_logs_default_to_beside_the_target(tmp_path, target):
    merger_args = ["merge", "--local_dir", "ckpt", *[a.format(t=tmp_path / "hf" / "step_1") for a in target]]
    assert default_folder(merger_args) == tmp_path / "hf" / "merger_slurm_logs" / "%j"
    assert build_parser().parse_args(["slurm"]).folder is None  # the default is decided from the target


def test_logs_without_a_target_go_to_the_current_folder():
    assert default_folder(["test", "--local_dir", "ckpt", "--test_hf_dir", "ref"]) == Path("merger_slurm_logs/%j")


def test_ray_mode_without_ray_says_how_to_install_it(monkeypatch, capsys):
    from launcher.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed: `import ray` fails
    assert main(["ray", "--nproc", "2", "--", "merge", "--local_dir", "ckpt", "--target_dir", "out"]) == 1
    assert capsys.readouterr().err == "launcher: error: the ray launcher needs Ray: pip install 'merger[ray]'\n"
