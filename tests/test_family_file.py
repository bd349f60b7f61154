"""`--family FILE`: a Megatron family given as a file (docs/families.md), on a checkpoint megatron-core wrote
(tests/writers/megatron_checkpoint.py's tp2_gqa_bias: Qwen2 with qkv biases, over 2 TP ranks; conftest's
megatron_root, shared with tests/test_megatron.py).

Oracles: Megatron's own CPU forward logits on the same tokens (the writer's logits.pt), which the model merged by
docs/families/qwen2.toml must reproduce, as the built-in family's does; the file's output is the built-in family's,
byte for byte. A file that does not fit the checkpoint is one line naming the file's row and the tensor it expected,
and leaves nothing at the target.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.in_process import merge_here, merge_in_process
from tests.helpers.logits import hf_logits
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.interpreter]

EXAMPLE = ROOT / "docs" / "families" / "qwen2.toml"
SMOLLM3 = ROOT / "docs" / "families" / "smollm3.toml"
CASE = "tp2_gqa_bias"


def _written(folder) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.glob("*.safetensors"))}


def test_the_docs_example_file_merges_as_the_built_in_family(megatron_root, tmp_path):
    """The file given by the Python API's keyword (as --family: the same parser), the built-in family by the CLI."""
    import merger.api

    source, hf = megatron_root / CASE / "legacy", megatron_root / CASE / "hf"
    given = tmp_path / "given"
    merger.api.merge(source, given, hf_model_config_path=hf, dtype="float32", family=EXAMPLE)
    built_in = merge_in_process(source, tmp_path / "built_in", "--hf_model_config_path", hf, "--dtype", "float32")
    assert _written(given) == _written(built_in) != {}
    oracle = torch.load(megatron_root / CASE / "logits.pt", weights_only=True)
    assert (hf_logits(given, oracle["tokens"], False) - oracle["logits"]).abs().max().item() < 1e-4


def test_a_file_adds_a_model_type_no_built_in_family_maps(megatron_root, tmp_path, capsys):
    """docs/families/smollm3.toml: Llama's layers under SmolLM3's model type, which merger has no family for. The
    mistral_tp2 checkpoint (Llama's layout) with its config.json made SmolLM3's of the same function (RoPE in every
    layer, no sliding window) is refused without the file; with it, the model reproduces Megatron's logits."""
    case, hf = megatron_root / "mistral_tp2", tmp_path / "hf"
    shutil.copytree(case / "hf", hf)
    config = json.loads((hf / "config.json").read_text())
    config.update(model_type="smollm3", architectures=["SmolLM3ForCausalLM"], use_sliding_window=False,
                  sliding_window=None, no_rope_layers=[1] * config["num_hidden_layers"])
    (hf / "config.json").write_text(json.dumps(config))
    common = ("--local_dir", case / "legacy", "--hf_model_config_path", hf, "--dtype", "float32")
    code, errors = merge_here(capsys, *common, "--target_dir", tmp_path / "refused")
    assert code == 1 and "no Megatron mapping for model_type 'smollm3'" in errors[0], errors
    merge_here_ok = merge_here(capsys, *common, "--target_dir", tmp_path / "out", "--family", SMOLLM3)
    assert merge_here_ok == (0, [])
    oracle = torch.load(case / "logits.pt", weights_only=True)
    assert (hf_logits(tmp_path / "out", oracle["tokens"], False) - oracle["logits"]).abs().max().item() < 1e-4


def test_a_family_file_for_a_checkpoint_of_hf_names_is_refused(megatron_root, tmp_path, capsys):
    """--family gives Megatron rows: a checkpoint mapped otherwise (here the HF folder a merge wrote) is refused,
    not merged as if the flag were not there."""
    source = megatron_root / CASE / "legacy"
    merged = merge_in_process(source, tmp_path / "merged", "--hf_model_config_path", megatron_root / CASE / "hf")
    code, errors = merge_here(capsys, "--local_dir", merged, "--target_dir", tmp_path / "out", "--family", EXAMPLE)
    assert code == 1 and errors == [f"merger: error: --family gives the rows of a Megatron checkpoint's family, and "
                                    f"this hf_safetensors checkpoint is mapped as hf, {merged}"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, expected", [
    # a misspelt source: its tensor has no row, and the row matches nothing
    (("\"self_attention.linear_qkv.weight\"", "\"self_atention.linear_qkv.weight\""),
     "row 'self_atention.linear_qkv.weight' of the family file matches no tensor of the checkpoint (it expects one "
     "named like decoder.layers.0.self_atention.linear_qkv.weight), and Megatron tensor decoder.layers."),
    # the row of the MLP's output projection left out: the tensor has no row, and no row is close to its name
    (("[[megatron]]\nsource = \"mlp.linear_fc2.weight\"\nkind = \"rename\"\ntargets = [\"mlp.down_proj.weight\"]", ""),
     "mlp.linear_fc2.weight of "),
    # the right name, the wrong transform: the MLP's output projection split as a fused QKV
    (("kind = \"rename\"\ntargets = [\"mlp.down_proj.weight\"]",
      "kind = \"qkv\"\ntargets = [\"mlp.down_proj.weight\", \"k\", \"v\"]"),
     "row 'mlp.linear_fc2.weight' of the family file does not fit the checkpoint: tensor "),
    (("model_types = [\"qwen2\"]", "model_types = [\"llama\"]"),
     "the family file maps model types llama, but config.json has model_type 'qwen2'"),
], ids=["a misspelt source", "a row left out", "a kind that does not fit", "another model type"])
def test_a_file_that_does_not_fit_the_checkpoint_is_one_line_naming_it(edit, expected, megatron_root, tmp_path, capsys):
    family = tmp_path / "family.toml"
    family.write_text(EXAMPLE.read_text().replace(*edit))
    assert family.read_text() != EXAMPLE.read_text()
    code, errors = merge_here(capsys, "--local_dir", megatron_root / CASE / "legacy", "--target_dir", tmp_path / "out",
                              "--hf_model_config_path", megatron_root / CASE / "hf", "--family", family)
    assert code == 1 and len(errors) == 1 and expected in errors[0] and errors[0].endswith(f", {family}"), errors
    assert not (tmp_path / "out").exists()


def test_resume_sees_a_family_file_fixed_under_the_same_path(megatron_root, tmp_path, capsys):
    """A family file whose two layer norms' targets were swapped, merged, then fixed in place: the same names, shapes
    and file header, other bytes. `--resume` must not take the finished merge for this one (before, the manifest
    held the file's path only, and it said 'nothing to do', keeping the swapped norms); `--overwrite` writes what the
    fixed file maps, the built-in family's bytes."""
    family, out = tmp_path / "qwen2.toml", tmp_path / "out"
    right = EXAMPLE.read_text()
    attention, mlp = ('targets = ["input_layernorm.weight"]', 'targets = ["post_attention_layernorm.weight"]')
    assert right.count(attention) == 2 and right.count(mlp) == 2  # each norm: the local and the TE spec's row
    family.write_text(right.replace(attention, "SWAP").replace(mlp, attention).replace("SWAP", mlp))
    common = ("--local_dir", megatron_root / CASE / "legacy", "--hf_model_config_path", megatron_root / CASE / "hf",
              "--target_dir", out, "--family", family)
    assert merge_here(capsys, *common) == (0, [])
    wrong = _written(out)
    family.write_text(right)
    code, errors = merge_here(capsys, *common, "--resume")
    assert code == 73 and errors == [f"merger: error: target folder holds an earlier merge: pass --overwrite to "
                                    f"replace it, {out}"], errors
    assert _written(out) == wrong
    assert merge_here(capsys, *common, "--overwrite") == (0, [])
    built_in = merge_in_process(megatron_root / CASE / "legacy", tmp_path / "built_in", "--hf_model_config_path",
                                megatron_root / CASE / "hf")
    assert _written(out) == _written(built_in) != wrong
