"""Usual mistakes get a hint in the one-line error, as real merger processes on a real verl FSDP checkpoint:
--local_dir one level too high, a run folder, a path inside the checkpoint, LoRA flags on a checkpoint with no
adapter, a config that names no model, a URL where a folder goes; and the dtypes as HF and verl users spell them."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from merger.cli import main
from merger.sources import BACKENDS
from tests.helpers.in_process import run_in_process, single_error_line
from tests.helpers.processes import run_merger
from tests.helpers.weights import assert_same_weights

pytestmark = pytest.mark.slow


def test_local_dir_one_level_too_high_names_the_checkpoint_below(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint("llama", world=1)
    step = actor.parent  # global_step_1/, which holds actor/
    proc = run_merger("merge", "--local_dir", step, "--target_dir", tmp_path / "out", check=False)
    assert proc.returncode == os.EX_NOINPUT and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"merger: error: no known checkpoint layout (looked for: {', '.join(BACKENDS)}), "
                           f"{step}; actor/ below it looks like a checkpoint (--backend fsdp): pass --local_dir ")
    assert not (tmp_path / "out").exists()
    # following the hint merges the model
    suggested = re.search(r"actor/ below it .*?: pass --local_dir (\S+)", line).group(1)
    run_in_process("merge", "--local_dir", suggested, "--target_dir", tmp_path / "out", "--dtype", "keep")
    assert_same_weights(tmp_path / "out", reference, None)


@pytest.mark.parametrize("flags, named", [(["--lora", "separate"], "--lora separate"),
                                          (["--lora_alpha", "16"], "--lora_alpha")])
def test_lora_flags_on_a_checkpoint_without_lora_are_an_error(fsdp_checkpoint, tmp_path, flags, named):
    actor, _ = fsdp_checkpoint("llama", world=1)
    proc = run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", *flags, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"merger: error: {named} applies to checkpoints with a LoRA adapter, and this fsdp checkpoint has none "
        f"(no lora_A / lora_B tensors), {actor}")
    assert not (tmp_path / "out").exists()


def _suggested(line: str) -> str:
    return re.search(r"--local_dir (\S+)$", line).group(1)


def test_run_folder_points_to_the_step_its_tracker_names(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint("llama", world=1)
    run = tmp_path / "run"
    for step in (1, 2):  # the tracker names step 1, not the highest-numbered folder
        shutil.copytree(actor, run / f"global_step_{step}" / "actor")
    (run / "latest_checkpointed_iteration.txt").write_text("1\n")
    proc = run_merger("merge", "--local_dir", run, "--target_dir", tmp_path / "out", check=False)
    line = single_error_line(proc.stderr)
    assert proc.returncode == os.EX_NOINPUT and line.endswith(
        f"{run}; it looks like a training run's folder: pass its latest checkpoint (fsdp), --local_dir "
        f"{run / 'global_step_1' / 'actor'}")
    run_in_process("merge", "--local_dir", _suggested(line), "--target_dir", tmp_path / "out", "--dtype", "keep")
    assert_same_weights(tmp_path / "out", reference, None)


@pytest.mark.parametrize("given, says", [
    ("huggingface", "this is a checkpoint's HF config folder: pass the checkpoint (fsdp), --local_dir {actor}"),
    ("model_world_size_1_rank_0.pt", "pass the folder that holds it: --local_dir {actor}"),
])
def test_a_path_inside_the_checkpoint_points_to_it(fsdp_checkpoint, tmp_path, given, says):
    actor, _ = fsdp_checkpoint("llama", world=1)
    proc = run_merger("merge", "--local_dir", actor / given, "--target_dir", tmp_path / "out", check=False)
    assert proc.returncode == os.EX_NOINPUT and single_error_line(proc.stderr).endswith(says.format(actor=actor))
    assert not (tmp_path / "out").exists()


def test_a_config_that_names_no_model_is_refused(fsdp_checkpoint, tmp_path):
    actor, _ = fsdp_checkpoint("llama", world=1)
    copy = Path(shutil.copytree(actor, tmp_path / "actor"))
    (copy / "huggingface" / "config.json").write_text("{}")
    proc = run_merger("merge", "--local_dir", copy, "--target_dir", tmp_path / "out", check=False)
    assert proc.returncode == 1 and single_error_line(proc.stderr) == (
        f"merger: error: config.json names no model (no model_type, no architectures): give the model's own config "
        f"(--hf_model_config_path), {copy / 'huggingface' / 'config.json'}")
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.merger-partial").exists()


@pytest.mark.parametrize("flag", ["--local_dir", "--target_dir", "--hf_model_config_path", "--summary_json"])
def test_a_url_is_refused_with_the_scheme_named(fsdp_checkpoint, tmp_path, flag, capsys, monkeypatch):
    """A flag that reads or writes buckets names the package gs:// needs (gcsfs, an extra: hidden here, as on a
    machine without it) and the extra that installs it; the flags that take no URL refuse gs:// at the flag. Neither leaves a folder `gs:/bucket/run` behind, as a URL read as a relative path would."""
    from merger.io import locations

    actor, _ = fsdp_checkpoint("llama", world=1)
    monkeypatch.chdir(tmp_path)
    import importlib

    registry = importlib.import_module("fsspec.registry")  # the module: `fsspec.registry` is its read-only view
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # `import gcsfs` raises ImportError
    for scheme in ("gs", "gcs"):  # and fsspec forgets the class an earlier test had it import
        monkeypatch.delitem(registry._registry, scheme, raising=False)
    monkeypatch.setattr(locations, "_OBJECT_STORAGES", {})  # no gs:// client an earlier test made
    args = {"--local_dir": str(actor), "--target_dir": "out", flag: "gs://bucket/run"}
    status = main(["merge", *[a for pair in args.items() for a in pair]])
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    if flag in ("--local_dir", "--hf_model_config_path", "--target_dir"):
        assert (status, err) == (1, "merger: error: gs:// needs the gcsfs package (pip install 'merger[gs]'), "
                                    "gs://bucket/run\n")
    else:
        assert status == 2 and err == (
            f"merger: error: argument {flag}/{flag.replace('_', '-')}: gs:// paths are not supported here: this flag "
            f"takes a local folder, or one of a mounted bucket (e.g. s3fs, gcsfuse, blobfuse2); --local_dir, "
            f"--hf_model_config_path, --base_model, --adapter, --adapter_config and --quantize_like read buckets "
            f"directly, and --target_dir writes to a bucket too, gs://bucket/run\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("spelling, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                             ("half", torch.float16), ("fp32", torch.float32),
                                             ("float", torch.float32)])
def test_dtype_as_hf_and_verl_spell_it(fsdp_checkpoint, tmp_path, spelling, dtype):
    actor, reference = fsdp_checkpoint("llama", world=1)
    run_in_process("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", "--dtype", spelling)
    assert_same_weights(tmp_path / "out", reference, dtype)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
