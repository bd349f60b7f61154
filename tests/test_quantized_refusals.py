"""Quantized formats merger does not read are refused with one line naming the format and the file, by every
command that reads such a folder: `merge` of it, `inspect` of it, `lora` into it as the base, `--quantize_like` it.
Their packed tensors are never copied through as if they were weights. A ModelOpt export with its KV cache quantized
is refused as a layout to write, and so as a LoRA base written back in its layout.

The releases are written by compressed-tensors itself (tests/writers/compressed_tensors_release.py: a tiny Llama
quantized as INT4 `pack-quantized` in groups of 32, `mxfp4-pack-quantized`, `nvfp4-pack-quantized`,
`mxfp8-quantized`, and the schemes merger does not read: `mxfp6-pack-quantized`, INT4 with zero points; saved as
llmcompressor saves one), or are such a release with its config.json edited to a scheme merger does not read.
ModelOpt's exports are written by ModelOpt (tests/writers/modelopt_release.py), edited the same way, config.json's
quantization_config edited to say the same. Oracles: what compressed-tensors wrote (the format its
config.json names, the packed tensors in its files), PEFT's adapter folder for the LoRA base, the process's exit code
and stderr, and the target's parent left as it was.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors import safe_open

from tests.helpers.files import snapshot
from tests.helpers.in_process import command_here, merge_here, single_error_line
from tests.helpers.processes import run_merger
from tests.writers.compressed_tensors_release import TINY

pytestmark = pytest.mark.slow

NOT_HANDLED = "a quantized format merger does not handle"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """The tiny Llama of the releases, unquantized: a source to quantize like one."""
    folder = tmp_path_factory.mktemp("plain") / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(torch.bfloat16).save_pretrained(folder)
    return folder


def release_format(release: Path) -> str:
    """The format compressed-tensors named in the release's config.json."""
    return json.loads((release / "config.json").read_text())["quantization_config"]["format"]


def scales(release: Path) -> list[str]:
    """The scales compressed-tensors wrote beside the quantized weights, in every format."""
    with safe_open(str(release / "model.safetensors"), "pt") as f:
        return [n for n in f.keys() if n.endswith(".weight_scale")]


def assert_refused(code: int, errors: list[str], what: str, file: Path, parent: Path, before: set[str]) -> None:
    """One error line naming `what` and ending with `file`, and nothing new in the target's parent."""
    assert code == 1 and len(errors) == 1 and what in errors[0] and errors[0].endswith(f", {file}"), errors
    assert {p.name for p in parent.iterdir()} == before


@pytest.mark.parametrize("dtype", ["bfloat16", "keep"])
@pytest.mark.parametrize("case, what", [
    ("mxfp6-pack-quantized", "compressed-tensors mxfp6-pack-quantized weights"),
    ("asymmetric pack-quantized", "compressed-tensors pack-quantized weights with symmetric=False in config group "
                                  "group_0")])
def test_merge_of_a_release_merger_does_not_read_is_refused(case, what, dtype, ct_release, tmp_path, capsys):
    """`--dtype keep` too: a reshard would copy the packed tensors as they are."""
    release = ct_release(case)
    assert release_format(release) in case and scales(release)  # compressed-tensors wrote quantized weights
    source, before = snapshot(release), {p.name for p in tmp_path.iterdir()}
    code, errors = merge_here(capsys, "--local_dir", release, "--target_dir", tmp_path / "out", "--dtype", dtype)
    assert_refused(code, errors, f"{what} (config.json's quantization_config), {NOT_HANDLED}",
                   release / "config.json", tmp_path, before)
    assert snapshot(release) == source


def _group(config: dict) -> dict:
    return config["quantization_config"]["config_groups"]["group_0"]


# a scheme merger does not read, written into the config.json of a release it reads -> what the error names
EDITS = {
    "group_size 128": (lambda c: _group(c)["weights"].update(group_size=128),
                       "with group_size=128 in config group group_0"),
    "actorder": (lambda c: _group(c)["weights"].update(actorder="group"),
                 "with actorder=group in config group group_0"),
    "a group of another format": (lambda c: c["quantization_config"]["config_groups"].update(
        group_1={**_group(c), "format": "float-quantized"}), "whose config group group_1 is another format"),
    "rotations": (lambda c: c["quantization_config"].update(transform_config={"config_groups": {"u": {}}}),
                  "with a transform_config"),
    "quantized KV cache": (lambda c: c["quantization_config"].update(kv_cache_scheme={"num_bits": 8}),
                           "with a kv_cache_scheme"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_scheme_merger_does_not_read_is_refused(edit, ct_release, tmp_path, capsys):
    """The INT4 release's config.json edited: what it then says its weights are is what merger would have to read."""
    release = Path(shutil.copytree(ct_release("pack-quantized"), tmp_path / "release"))
    config = json.loads((release / "config.json").read_text())
    change, what = EDITS[edit]
    change(config)
    (release / "config.json").write_text(json.dumps(config))
    before = {p.name for p in tmp_path.iterdir()}
    code, errors = merge_here(capsys, "--local_dir", release, "--target_dir", tmp_path / "out")
    assert_refused(code, errors, f"compressed-tensors pack-quantized weights {what} (config.json's "
                   f"quantization_config), {NOT_HANDLED}", release / "config.json", tmp_path, before)


def test_a_part_the_format_does_not_store_is_refused(ct_release, tmp_path, capsys):
    """The asymmetric INT4 release with its config.json saying symmetric: its `weight_zero_point`s are then parts
    no step reads, and no weights either."""
    release = Path(shutil.copytree(ct_release("asymmetric pack-quantized"), tmp_path / "release"))
    config = json.loads((release / "config.json").read_text())
    _group(config)["weights"]["symmetric"] = True
    (release / "config.json").write_text(json.dumps(config))
    before = {p.name for p in tmp_path.iterdir()}
    code, errors = merge_here(capsys, "--local_dir", release, "--target_dir", tmp_path / "out")
    assert_refused(code, errors, "is part of a quantized weight (weight_zero_point) that config.json does not "
                   "describe (its quantization_config says compressed-tensors pack-quantized)",
                   release / "model.safetensors", tmp_path, before)


def test_inspect_of_a_release_is_refused(ct_release, capsys):
    release = ct_release("mxfp6-pack-quantized")
    code, errors = command_here(capsys, "inspect", "--local_dir", release)
    assert code == 1 and len(errors) == 1 and "compressed-tensors mxfp6-pack-quantized weights" in errors[0]
    assert errors[0].endswith(f", {release / 'config.json'}")


@pytest.mark.interpreter
def test_the_refusal_is_one_line_and_no_traceback_from_a_process(ct_release, tmp_path):
    release = ct_release("asymmetric pack-quantized")
    proc = run_merger("merge", "--local_dir", release, "--target_dir", tmp_path / "out", check=False)
    error = single_error_line(proc.stderr)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "compressed-tensors pack-quantized weights with symmetric=False" in error
    assert error.endswith(f", {release / 'config.json'}") and not (tmp_path / "out").exists()


def test_packed_tensors_that_no_config_describes_are_refused(ct_release, tmp_path, capsys):
    """The INT4 release with its quantization_config taken out: nothing then says how to read `weight_packed`,
    `weight_scale`, `weight_shape`, and none of them is a weight."""
    release = Path(shutil.copytree(ct_release("pack-quantized"), tmp_path / "release"))
    config = json.loads((release / "config.json").read_text())
    del config["quantization_config"]
    (release / "config.json").write_text(json.dumps(config))
    before = {p.name for p in tmp_path.iterdir()}
    code, errors = merge_here(capsys, "--local_dir", release, "--target_dir", tmp_path / "out")
    assert_refused(code, errors, "is part of a quantized weight (weight_", release / "model.safetensors", tmp_path,
                   before)
    assert "that config.json does not describe (it has no quantization_config)" in errors[0]


# hf_quant_config.json's `quantization` key -> where config.json's quantization_config says the same, as
# ModelOpt 0.47's export writes it (convert_hf_quant_config_format)
IN_CONFIG_JSON = {"quant_algo": lambda qc: qc, "kv_cache_quant_algo": lambda qc: qc, "exclude_modules": lambda qc: qc,
                  "group_size": lambda qc: qc["config_groups"]["group_0"]["weights"]}
CONFIG_JSON_KEY = {"kv_cache_quant_algo": "kv_cache_scheme", "exclude_modules": "ignore"}


def _modelopt_edited(release: Path, folder: Path, change: dict, config_too: bool = True) -> Path:
    """A copy of ModelOpt's export with `change` made to hf_quant_config.json's `quantization` and, with
    `config_too`, to config.json's quantization_config where that says the same, so that the two agree."""
    export = Path(shutil.copytree(release, folder))
    described = json.loads((export / "hf_quant_config.json").read_text())
    described["quantization"].update(change)
    (export / "hf_quant_config.json").write_text(json.dumps(described))
    config = json.loads((export / "config.json").read_text())
    for key, value in change.items() if config_too else ():
        IN_CONFIG_JSON[key](config["quantization_config"])[CONFIG_JSON_KEY.get(key, key)] = value
    (export / "config.json").write_text(json.dumps(config))
    return export


# an algorithm or scheme merger does not read, written into a ModelOpt NVFP4 export's descriptions -> what is named
MODELOPT_EDITS = {
    "FP8": (dict(quant_algo="FP8"), "ModelOpt FP8 weights (hf_quant_config.json)"),
    "W4A8_AWQ": (dict(quant_algo="W4A8_AWQ"), "ModelOpt W4A8_AWQ weights (hf_quant_config.json)"),
    "groups of 32": (dict(group_size=32), "ModelOpt NVFP4 weights in groups of 32, not 16 (hf_quant_config.json)"),
    "an NVFP4 KV cache": (dict(kv_cache_quant_algo="NVFP4"),
                          "ModelOpt NVFP4 weights with kv_cache_quant_algo NVFP4 (hf_quant_config.json)"),
}


@pytest.mark.parametrize("edit", list(MODELOPT_EDITS))
def test_a_modelopt_algorithm_merger_does_not_read_is_refused(edit, mo_release, tmp_path, capsys):
    """ModelOpt's NVFP4 export (tests/writers/modelopt_release.py) saying it is another algorithm or scheme:
    hf_quant_config.json, the file ModelOpt describes its export in, is the one named."""
    change, what = MODELOPT_EDITS[edit]
    export = _modelopt_edited(mo_release("nvfp4"), tmp_path / "export", change)
    before = {p.name for p in tmp_path.iterdir()}
    code, errors = merge_here(capsys, "--local_dir", export, "--target_dir", tmp_path / "out")
    assert_refused(code, errors, f"{what}, {NOT_HANDLED}", export / "hf_quant_config.json", tmp_path, before)


def test_modelopt_descriptions_that_disagree_are_refused(mo_release, tmp_path, capsys):
    """hf_quant_config.json saying MXFP8 where config.json's quantization_config says NVFP4: neither is taken."""
    export = _modelopt_edited(mo_release("nvfp4"), tmp_path / "export", dict(quant_algo="MXFP8", group_size=32),
                              config_too=False)
    before = {p.name for p in tmp_path.iterdir()}
    code, errors = merge_here(capsys, "--local_dir", export, "--target_dir", tmp_path / "out")
    assert_refused(code, errors, "ModelOpt weights whose hf_quant_config.json and config.json's quantization_config "
                   "disagree on quant_algo, group_size", export / "hf_quant_config.json", tmp_path, before)


def test_a_quantized_layer_the_export_excludes_is_refused(mo_release, tmp_path, capsys):
    """exclude_modules naming (by a pattern) layers whose weight_scale the files hold: the files and the
    description disagree on what is quantized."""
    export = _modelopt_edited(mo_release("nvfp4"), tmp_path / "export",
                              dict(exclude_modules=["lm_head", "model.layers.1.mlp.*"]))
    before = {p.name for p in tmp_path.iterdir()}
    code, errors = merge_here(capsys, "--local_dir", export, "--target_dir", tmp_path / "out")
    assert_refused(code, errors, "quantizes model.layers.1.mlp.", export / "model.safetensors", tmp_path, before)
    assert "which hf_quant_config.json excludes ('model.layers.1.mlp.*')" in errors[0]


def test_quantize_like_or_a_lora_into_a_modelopt_export_with_a_kv_cache_is_refused(mo_release, plain, tmp_path,
                                                                                    capsys):
    """merger writes NVFP4 exports (test_modelopt_nvfp4_write.py), but not one with its KV cache quantized (ModelOpt's
    FP8 KV-cache preset), whose k_scale and v_scale calibrate the cache on data: as --quantize_like's release, nor as
    a LoRA base written back in its layout (`merger lora`'s default, --dtype keep)."""
    adapter = tmp_path / "adapter"
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(adapter)
    before = {p.name for p in tmp_path.iterdir()}
    release = mo_release("nvfp4", "fp8")
    with safe_open(str(release / "model.safetensors"), "pt") as f:
        assert any(name.endswith(".k_scale") for name in f.keys())  # ModelOpt wrote its KV cache's scales
    code, errors = merge_here(capsys, "--local_dir", plain, "--target_dir", tmp_path / "out", "--quantize_like",
                              release)
    assert_refused(code, errors, "ModelOpt NVFP4 with its KV cache quantized (FP8) as --quantize_like's release: its "
                   "k_scale and v_scale calibrate the cache on data merger does not have",
                   release / "hf_quant_config.json", tmp_path, before)
    code, errors = command_here(capsys, "lora", "--base_model", release, "--adapter", adapter, "--target_dir",
                                tmp_path / "out")
    assert_refused(code, errors, "ModelOpt NVFP4 with its KV cache quantized (FP8) as --quantize_like's release: its "
                   "k_scale and v_scale calibrate the cache on data merger does not have",
                   release / "hf_quant_config.json", tmp_path, before)
