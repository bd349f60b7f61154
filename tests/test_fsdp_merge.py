"""verl FSDP checkpoints written by torch's fully_shard, merged with 1, 2 and 3 ranks, checked against the
model's own weights (save_pretrained's output of the unsharded model) and its own logits."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from tests.helpers.in_process import merge_in_process
from tests.helpers.processes import run_merger
from tests.helpers.weights import assert_same_weights, load_safetensors_folder

pytestmark = pytest.mark.slow


def same_logits(merged, reference, dtype) -> None:
    """The merged folder, loaded by transformers, computes exactly what the original model cast to dtype does."""
    ours = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    orig = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=dtype).eval()
    assert ours.dtype == dtype
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, orig(ids).logits)


@pytest.mark.interpreter  # the command line end to end, as one process and under torchrun
@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_uneven_fsdp2_llama_any_merge_world(fsdp_checkpoint, tmp_path, nproc):
    # W=4 with vocab 101: every embedding shard has a different size, the last one smaller.
    actor, reference = fsdp_checkpoint("llama", world=4, extra=("--buffer",))
    out = tmp_path / "merged"
    run_merger("merge", "--backend", "fsdp", "--local_dir", actor, "--target_dir", out, nproc=nproc, torchrun=True)
    assert_same_weights(out, reference, torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert not list(tmp_path.glob(".*merger-partial"))


def test_replicated_buffer_is_kept_once(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint("llama", world=4, extra=("--buffer",))
    out = tmp_path / "merged"
    merge_in_process(actor, out, "--dtype", "keep")
    merged = load_safetensors_folder(out)
    assert torch.equal(merged["model.scale_table"], torch.arange(7, dtype=torch.float32) / 7)
    assert_same_weights(out, reference, None)


def test_hsdp_qwen2_with_qkv_bias_loads_with_identical_logits(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint("qwen2", world=4, mesh="2,2")
    out = tmp_path / "merged"
    run_merger("merge", "--local-dir", actor, "--target-dir", out, nproc=2)
    assert_same_weights(out, reference, torch.bfloat16)
    same_logits(out, reference, torch.bfloat16)


def test_tied_embeddings_written_once(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint("llama", world=2, tied=True)
    out = tmp_path / "merged"
    merge_in_process(actor, out, "--dtype", "float32")
    assert "lm_head.weight" not in load_safetensors_folder(out)
    assert_same_weights(out, reference, torch.float32)
    same_logits(out, reference, torch.float32)


def test_single_process_save_of_gpt2_conv1d_plain_tensors(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint("gpt2", world=1, extra=("--no-fsdp-config",))
    out = tmp_path / "merged"
    merge_in_process(actor, out, "--dtype", "float16")
    assert_same_weights(out, reference, torch.float16)
    same_logits(out, reference, torch.float16)


def test_sharded_output_index_and_limits(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint("llama", world=4, extra=("--buffer",))
    out = tmp_path / "merged"
    run_merger("merge", "--local_dir", actor, "--target_dir", out, "--max_shard_size", "8KB", nproc=2)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) > 2 and {f.name for f in files} == set(index["weight_map"].values())
    total = 0
    for f in files:
        with safe_open(f, "pt") as h:
            assert h.metadata() == {"format": "pt"}
            sizes = [h.get_slice(k).get_shape() for k in h.keys()]
            nbytes = sum(2 * torch.Size(s).numel() for s in sizes)
            # a file goes over the limit only when it holds a single tensor larger than the limit
            assert nbytes <= 8000 or len(sizes) == 1
            total += nbytes
            for k in h.keys():
                assert index["weight_map"][k] == f.name
    assert index["metadata"]["total_size"] == total
    assert_same_weights(out, reference, torch.bfloat16)


def test_layer_order_within_files(fsdp_checkpoint, tmp_path):
    actor, _ = fsdp_checkpoint("llama", world=4, extra=("--buffer",))
    out = tmp_path / "merged"
    merge_in_process(actor, out)
    header_len = int.from_bytes((out / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((out / "model.safetensors").read_bytes()[8:8 + header_len])
    header.pop("__metadata__")
    by_offset = [k for k, _ in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])]
    layer_of = [int(k.split(".")[2]) for k in by_offset if k.startswith("model.layers.")]
    assert layer_of == sorted(layer_of)


def test_test_command_passes_on_right_reference_and_fails_on_wrong(fsdp_checkpoint, tmp_path):
    actor, reference = fsdp_checkpoint("llama", world=4, extra=("--buffer",))
    ok = run_merger("test", "--local_dir", actor, "--test_hf_dir", reference, nproc=2)
    assert "PASSED" in ok.stdout
    _, other_reference = fsdp_checkpoint("llama", world=1, extra=("--buffer", "--seed", "1"))
    bad = run_merger("test", "--local_dir", actor, "--test_hf_dir", other_reference, check=False)
    assert bad.returncode == 1 and "FAILED" in bad.stdout and "values differ" in bad.stdout


def test_inspect_describes_without_merging(fsdp_checkpoint, tmp_path):
    actor, _ = fsdp_checkpoint("qwen2", world=4, mesh="2,2")
    proc = run_merger("inspect", "--local_dir", actor, "--json", "--max_shard_size", "20KB")
    info = json.loads(proc.stdout)
    assert info["format"] == "fsdp" and info["world_size"] == 4
    assert info["meshes"] == ["(2, 2) ('ddp', 'fsdp')"]
    assert info["placements"] == ["('R', 'S(0)')"]
    assert len(info["output_files"]) > 1
    assert sum(f["tensors"] for f in info["output_files"]) == info["tensors"]
