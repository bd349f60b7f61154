"""`--dtype X` writes every tensor in the dtype transformers' save_pretrained gives it for the model class at X.

transformers keeps some modules in float32 at lower dtypes (`_keep_in_fp32_modules_strict` at bfloat16 and
float16, `_keep_in_fp32_modules` at float16): DeepSeek-V3's router `mlp.gate.weight` and its
`e_score_correction_bias`. Oracle: transformers itself, loading the unquantized model at X and saving it with
save_pretrained; the dtypes of merger's output must be those, tensor for tensor. The sources: a DeepSeek-V3 FP8
release (tests/writers/fp8_release.py, the bias stored in float32 as DeepSeek's release stores it) and a
torchtitan DeepSeek-V3 checkpoint (torchtitan keeps its expert bias in float32).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from tests.helpers.in_process import merge_in_process, run_in_process
from tests.helpers.processes import run, run_merger
from tests.helpers.weights import load_safetensors_folder
from tests.writers.fp8_release import write_release

pytestmark = pytest.mark.slow

DTYPES = ["bfloat16", "float16", "float32"]


def saved_dtypes(folder) -> dict[str, torch.dtype]:
    dtypes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            dtypes.update({name: f.get_tensor(name).dtype for name in f.keys()})
    return dtypes


def save_pretrained_dtypes(model_dir, dtype: str, tmp_path) -> dict[str, torch.dtype]:
    """The oracle: the dtypes save_pretrained writes for the model transformers loads at `dtype`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.save_pretrained(tmp_path / f"saved-{dtype}")
    return saved_dtypes(tmp_path / f"saved-{dtype}")


@pytest.fixture(scope="module")
def deepseek_release(tmp_path_factory):
    """(FP8 release, the same model unquantized in float32)."""
    root = tmp_path_factory.mktemp("deepseek_fp8")
    return write_release(root / "release", (16, 16), family="deepseek_v3", reference=root / "reference"), \
        root / "reference"


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_release_dtypes_are_save_pretrained_s(deepseek_release, tmp_path, dtype):
    release, reference = deepseek_release
    out = merge_in_process(release, tmp_path / "out", "--dtype", dtype)
    want = save_pretrained_dtypes(reference, dtype, tmp_path)
    assert saved_dtypes(out) == want
    assert any(d == torch.float32 for d in want.values())  # the test means something at every dtype


def test_keep_in_fp32_tensors_hold_the_release_s_values(deepseek_release, tmp_path):
    """The float32 bias is written as stored (bfloat16 would round it); the bfloat16 router weight widened."""
    release, _ = deepseek_release
    got = load_safetensors_folder(merge_in_process(release, tmp_path / "out", "--dtype", "bfloat16"))
    stored = load_safetensors_folder(release)
    bias, gate = "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.gate.weight"
    assert stored[bias].dtype == torch.float32 and not torch.equal(stored[bias].bfloat16().float(), stored[bias])
    assert got[bias].dtype == torch.float32 and torch.equal(got[bias], stored[bias])
    assert got[gate].dtype == torch.float32 and torch.equal(got[gate], stored[gate].float())


def test_the_log_names_the_tensors_kept_in_float32(deepseek_release, tmp_path):
    release, _ = deepseek_release
    proc = run_merger("merge", "--local_dir", release, "--target_dir", tmp_path / "out")
    assert ("merger: 2 tensors written in float32, as transformers keeps e_score_correction_bias, gate.weight in "
            "float32 at bfloat16 (e.g. model.layers.1.mlp.gate.e_score_correction_bias)") in proc.stderr


def test_torchtitan_deepseek_v3_dtypes_are_save_pretrained_s(deepseek_v3_root, tmp_path):
    """From torchtitan's float32 checkpoint at bfloat16 on 2 ranks: the router stays float32, with torchtitan's
    values; the oracle loads merger's float32 merge (only transformers decides the dtypes)."""
    args = ["--local_dir", deepseek_v3_root / "checkpoint" / "step-1", "--hf_model_config_path",
            deepseek_v3_root / "hf"]
    run_in_process("merge", *args, "--target_dir", tmp_path / "fp32", "--dtype", "float32")
    run_merger("merge", *args, "--target_dir", tmp_path / "bf16", "--dtype", "bfloat16", nproc=2)
    want = save_pretrained_dtypes(tmp_path / "fp32", "bfloat16", tmp_path)
    assert saved_dtypes(tmp_path / "bf16") == want
    fp32, bf16 = load_safetensors_folder(tmp_path / "fp32"), load_safetensors_folder(tmp_path / "bf16")
    kept = [name for name, d in want.items() if d == torch.float32]
    assert kept and all(torch.equal(bf16[name], fp32[name]) for name in kept)


def _built_on_meta(model_type: str, arch: str):
    """transformers' `arch` from its default config cut to one layer, built on the meta device (post_init joins
    the lists of the models it holds); None where transformers cannot build it so here (a missing optional
    dependency, a config that needs arguments)."""
    try:
        config = transformers.AutoConfig.for_model(model_type)
        for key in ("num_hidden_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers"):
            if isinstance(getattr(config, key, None), int):
                setattr(config, key, 1)
        with torch.device("meta"):
            return getattr(transformers, arch)(config), config
    except Exception:  # noqa: BLE001 - a model this transformers cannot build here: nothing to compare
        return None


def test_the_keep_in_fp32_lists_are_those_of_the_model_transformers_builds():
    """Oracle: for every model type whose transformers source names a keep-in-fp32 list, the model transformers
    builds from its config: its lists after post_init, at bfloat16 (the strict one) and float16 (both). merger
    reads them from the sources without importing transformers; a class's own attributes would not do: HY-V4's
    causal LM names only lm_head, its base model the rest."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    from merger.mapping.keep_in_fp32 import keep_in_fp32

    models = Path(transformers.__file__).parent / "models"
    types = sorted({p.parent.name for p in models.glob("*/modeling_*.py") if "_keep_in_fp32_modules" in p.read_text()})
    compared, joined = [], []
    for model_type in types:
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_MAPPING_NAMES.get(model_type)
        if arch is None or (built := _built_on_meta(model_type, arch)) is None:
            continue
        model, config = built
        strict, loose = set(model._keep_in_fp32_modules_strict), set(model._keep_in_fp32_modules)
        config = {**config.to_dict(), "architectures": [arch]}
        assert set(keep_in_fp32(config, torch.bfloat16)) == strict, model_type
        assert set(keep_in_fp32(config, torch.float16)) == strict | loose, model_type
        assert keep_in_fp32(config, torch.float32) == ()
        compared.append(model_type)
        if strict != set(type(model)._keep_in_fp32_modules_strict or ()):
            joined.append(model_type)  # post_init added a held model's list to the class's
    assert len(compared) > 30 and "deepseek_v3" in compared and joined, (compared, joined)


def test_the_keep_in_fp32_lists_are_read_without_importing_transformers(tmp_path):
    """DeepSeek-V3 keeps its router in float32: found, with no module of transformers imported (importing the
    model's module cost a rank 3.7 s here)."""
    config = {**transformers.AutoConfig.for_model("deepseek_v3").to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = ("import json, sys, torch; from merger.mapping.keep_in_fp32 import keep_in_fp32; "
            f"print(keep_in_fp32(json.load(open({str(tmp_path / 'config.json')!r})), torch.bfloat16), "
            "sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'huggingface_hub'}))")
    assert run([sys.executable, "-c", code]).stdout.strip() == "('e_score_correction_bias', 'gate.weight') []"


def test_a_model_type_whose_folder_is_not_its_name_finds_its_class_through_transformers():
    """transformers keeps some models in a folder their model type does not name (`kosmos-2.5` in kosmos2_5/): the
    class config.json names is then found through transformers, and its lists read from its source."""
    from merger.mapping.keep_in_fp32 import keep_in_fp32

    config = {**transformers.AutoConfig.for_model("deepseek_v3").to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    assert keep_in_fp32({**config, "model_type": "deepseek-v3.renamed"}, torch.bfloat16) == \
        keep_in_fp32(config, torch.bfloat16) == ("e_score_correction_bias", "gate.weight")


def loads_as_stored(folder) -> bool:
    """The oracle for config.json's dtype: transformers loading the folder with no dtype (it reads config.json's)
    gives every parameter the dtype the folder stores it in."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    stored = saved_dtypes(folder)
    return all(p.dtype == stored[name] for name, p in model.named_parameters() if name in stored)


def test_a_config_folder_target_states_the_weights_dtype(fsdp_checkpoint, tmp_path):
    """verl saves actor/huggingface/config.json with float32, the dtype it trained in; merged into that folder
    at bfloat16, the config must say bfloat16 (and nothing else in it changes)."""
    actor = Path(shutil.copytree(fsdp_checkpoint("llama", 2)[0], tmp_path / "actor"))
    hf = actor / "huggingface"
    given = json.loads((hf / "config.json").read_text())
    assert given["dtype"] == "float32"
    merge_in_process(actor, hf, "--dtype", "bfloat16")
    assert json.loads((hf / "config.json").read_text()) == {**given, "dtype": "bfloat16"}
    assert set(saved_dtypes(hf).values()) == {torch.bfloat16} and loads_as_stored(hf)
    manifest = json.loads((hf / "merge_manifest.json").read_text())
    assert "config.json" not in manifest["added_files"]  # the source's file: a later merge never removes it


@pytest.mark.parametrize("keys", [("dtype",), ("dtype", "torch_dtype"), ("torch_dtype",)])
def test_keep_states_the_dtype_the_weights_keep(fsdp_checkpoint, tmp_path, keys):
    """A float32 checkpoint whose config says bfloat16 (copied from the release it was trained from), merged with
    --dtype keep: the config says float32, in the key or keys it had."""
    actor = Path(shutil.copytree(fsdp_checkpoint("llama", 2)[0], tmp_path / "actor"))
    config = {k: v for k, v in json.loads((actor / "huggingface" / "config.json").read_text()).items()
              if k not in ("dtype", "torch_dtype")}
    (actor / "huggingface" / "config.json").write_text(json.dumps({**config, **dict.fromkeys(keys, "bfloat16")}))
    out = merge_in_process(actor, tmp_path / "out", "--dtype", "keep")
    written = json.loads((out / "config.json").read_text())
    assert {k: written.get(k) for k in ("dtype", "torch_dtype")} == \
        {"dtype": "float32", "torch_dtype": "float32" if "torch_dtype" in keys else None}
    assert set(saved_dtypes(out).values()) == {torch.float32} and loads_as_stored(out)


def test_keep_with_mixed_dtypes_states_save_pretrained_s(deepseek_release, tmp_path):
    """A bfloat16 model with its router kept in float32 (merger's own output), its config edited to say float32,
    merged again with --dtype keep: the config says what save_pretrained writes for that model, bfloat16 (its
    first floating-point parameter's), and transformers loads each tensor in the dtype stored."""
    release, reference = deepseek_release
    mixed = merge_in_process(release, tmp_path / "mixed", "--dtype", "bfloat16")
    want = tmp_path / "saved"
    transformers.AutoModelForCausalLM.from_pretrained(mixed, dtype=torch.bfloat16).save_pretrained(want)
    config = json.loads((mixed / "config.json").read_text())
    (mixed / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    out = merge_in_process(mixed, tmp_path / "out", "--dtype", "keep")
    assert {torch.bfloat16, torch.float32} <= set(saved_dtypes(out).values())
    assert json.loads((out / "config.json").read_text())["dtype"] == json.loads((want / "config.json").read_text())[
        "dtype"] == "bfloat16"
    assert loads_as_stored(out)
