"""`--hf_model_config_path` given as a Hugging Face Hub model id, found in huggingface_hub's cache with
HF_HUB_OFFLINE set (there is no network here; --base_model as a Hub id is tested in test_lora.py).

The checkpoint is a real verl FSDP save (conftest's fsdp_checkpoint) whose huggingface/ folder is moved into a
cache laid out as huggingface_hub's (tests/helpers/hub_cache.py, checked by huggingface_hub's own scan_cache_dir). The
oracles are the model's own weights (save_pretrained) and the config files as training saved them.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.hub_cache import cache_model, offline_env
from tests.helpers.in_process import single_error_line
from tests.helpers.processes import run_merger
from tests.helpers.weights import assert_same_weights

pytestmark = pytest.mark.slow

REPO = "merger-test/tiny-llama"


@pytest.fixture
def pristine(fsdp_checkpoint) -> tuple[Path, Path]:
    return fsdp_checkpoint("llama", 2)


@pytest.fixture
def actor(pristine, tmp_path) -> Path:
    """A copy of the checkpoint without its huggingface/ folder."""
    copy = Path(shutil.copytree(pristine[0], tmp_path / "global_step_1" / "actor"))
    shutil.rmtree(copy / "huggingface")
    return copy


def test_config_path_as_a_hub_id_merges_from_the_cache(pristine, actor, tmp_path):
    cache = tmp_path / "hub"
    cache_model(cache, REPO, pristine[0] / "huggingface")
    run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", "--hf_model_config_path", REPO,
               env=offline_env(cache))
    assert_same_weights(tmp_path / "out", pristine[1], torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (pristine[0] / "huggingface" / name).read_bytes(), name


def test_a_hub_id_not_in_the_cache_offline_is_one_line_naming_it(actor, tmp_path):
    cache = tmp_path / "hub"
    cache.mkdir()
    proc = run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", "--hf_model_config_path",
                      REPO, env=offline_env(cache), check=False)
    assert proc.returncode == 1
    error = single_error_line(proc.stderr)
    assert f"Hub model {REPO} is not in the Hugging Face cache ({cache}) with HF_HUB_OFFLINE set" in error, error
    assert error.endswith(f", {REPO}") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("given", [f"./{REPO}", f"/{REPO}", f"{REPO}/config"])
def test_a_path_shaped_value_is_never_looked_up_on_the_hub(given, pristine, actor, tmp_path):
    """`./owner/name`, an absolute path or two slashes name a local folder, even when the cache holds the model."""
    cache = tmp_path / "hub"
    cache_model(cache, REPO, pristine[0] / "huggingface")
    proc = run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", "--hf_model_config_path",
                      given, env=offline_env(cache), check=False)
    assert proc.returncode == os.EX_NOINPUT
    assert single_error_line(proc.stderr).startswith("merger: error: HF config folder does not exist"), proc.stderr


def test_a_local_folder_named_like_a_hub_id_is_the_folder(pristine, actor, tmp_path, monkeypatch):
    """A folder `owner/name` in the working directory is that folder: no Hub look-up (none could succeed here)."""
    from merger.cli import main

    shutil.copytree(pristine[0] / "huggingface", tmp_path / "cwd" / REPO)
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(["merge", "--local_dir", str(actor), "--target_dir", str(tmp_path / "out"),
                 "--hf_model_config_path", REPO]) == 0
    assert_same_weights(tmp_path / "out", pristine[1], torch.bfloat16)
