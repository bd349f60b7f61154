"""torch.distributed.checkpoint input: FSDP2 dcp.save, accelerate's nested HSDP form, torchtitan Llama.

Checkpoints are written by the real libraries under torchrun/gloo (tests/writers/dcp_checkpoint.py and
torchtitan_checkpoint.py), once per session. Oracles: the model's own save_pretrained output (bit-exact)
and, for torchtitan, torchtitan's own Llama3StateDictAdapter.to_hf (bit-exact) plus the rotary maths of
torchtitan and transformers for the permutation alone.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.enums_by_name import repickle
from tests.helpers.files import flip_bit_in_tensor, metadata_naming
from tests.helpers.in_process import merge_in_process, single_error_line
from tests.helpers.processes import run_merger, run_writer
from tests.helpers.skips import need_torchtitan
from tests.helpers.weights import assert_same_weights, load_safetensors_folder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def torchtitan_root(tmp_path_factory) -> Path:
    need_torchtitan()
    root = tmp_path_factory.mktemp("torchtitan")
    run_writer("torchtitan_checkpoint.py", "--family", "llama", "--out", root / "checkpoint" / "step-1", "--hf",
               root / "hf", "--reference", root / "reference", nproc=2)
    return root


@pytest.mark.interpreter  # dcp_root's .metadata holds this interpreter's own pickles
def test_fsdp2_dcp_save_one_process(dcp_root, tmp_path):
    merge_in_process(dcp_root / "plain", tmp_path / "out")
    assert_same_weights(tmp_path / "out", dcp_root / "reference", torch.bfloat16)
    # the config and tokenizer came from huggingface/ inside the DCP folder
    assert (tmp_path / "out" / "tokenizer.json").is_file()


@pytest.mark.interpreter  # the command line end to end, under torchrun
def test_accelerate_hsdp_torchrun_other_world_size(dcp_root, tmp_path):
    """checkpoint-N given: pytorch_model_fsdp_0/ found, `model.` nesting and the optimizer dropped, 3 ranks.
    FSDP2's Shard(0) chunks are written where they are read: nothing crosses ranks, replicas are read once."""
    run_merger("merge", "--local_dir", dcp_root / "checkpoint-1", "--target_dir", tmp_path / "out",
               "--hf_model_config_path", dcp_root / "hf", "--dtype", "keep", "--device", "cpu",
               "--summary_json", tmp_path / "summary.json", nproc=3, torchrun=True)
    assert_same_weights(tmp_path / "out", dcp_root / "reference", None)
    moved = json.loads((tmp_path / "summary.json").read_text())["bytes_per_rank"]
    assert [m["sent_bytes"] + m["received_bytes"] for m in moved] == [0, 0, 0]
    merged = load_safetensors_folder(tmp_path / "out")
    assert sum(m["read_bytes"] for m in moved) == sum(m["written_bytes"] for m in moved) == \
        sum(t.numel() * t.element_size() for t in merged.values())



def test_kept_dtype_from_another_filesystem(dcp_root, tmp_path, other_filesystem):
    """Chunks kept as stored are copied inside the kernel; from a checkpoint on another filesystem (tmpfs), where
    the kernel refuses to copy between the two, they go through memory instead, with the same result."""
    source = other_filesystem / "plain"
    shutil.copytree(dcp_root / "plain", source)
    run_merger("merge", "--local_dir", source, "--target_dir", tmp_path / "out", "--dtype", "keep", nproc=2)
    assert_same_weights(tmp_path / "out", dcp_root / "reference", None)


@pytest.mark.parametrize("nproc", [1, 2])
def test_tensor_parallel_column_blocks_are_written_where_read(dcp_tp_root, nproc, tmp_path):
    """Row-wise parallel weights (o_proj, down_proj) are saved as DTensor Shard(1) column blocks: each merge rank
    casts the blocks it reads and writes them row by row at their offsets, so no byte crosses ranks; the result
    is the model's own weights cast to bf16, bit for bit."""
    run_merger("merge", "--local_dir", dcp_tp_root / "checkpoint", "--target_dir", tmp_path / "out", "--device", "cpu",
               "--summary_json", tmp_path / "summary.json", nproc=nproc)
    assert_same_weights(tmp_path / "out", dcp_tp_root / "reference", torch.bfloat16)
    moved = json.loads((tmp_path / "summary.json").read_text())["bytes_per_rank"]
    assert [m["sent_bytes"] + m["received_bytes"] for m in moved] == [0] * nproc
    assert all(m["written_bytes"] > 0 for m in moved)

def test_accelerate_model_folder_with_prefix_flag(dcp_root, tmp_path):
    merge_in_process(dcp_root / "checkpoint-1" / "pytorch_model_fsdp_0", tmp_path / "out", "--prefix", "model",
                     "--hf_model_config_path", dcp_root / "hf", "--dtype", "keep")
    assert_same_weights(tmp_path / "out", dcp_root / "reference", None)


def test_accelerate_without_config_names_the_flag(dcp_root, tmp_path):
    proc = run_merger("merge", "--local_dir", dcp_root / "checkpoint-1", "--target_dir", tmp_path / "out",
                      check=False)
    assert proc.returncode == os.EX_NOINPUT
    assert "merger: error:" in proc.stderr and "--hf_model_config_path" in proc.stderr
    assert not (tmp_path / "out").exists()


class _Payload:
    """Unpickling this calls os.mkdir(marker): what a hostile .metadata could do with torch's own reader."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.mkdir, (self.marker,)


@pytest.mark.interpreter  # what the restricted unpickler refuses
def test_hostile_metadata_is_refused_without_running_code(dcp_root, tmp_path):
    folder = tmp_path / "hostile"
    shutil.copytree(dcp_root / "plain", folder)
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    proc = run_merger("inspect", "--local_dir", folder, check=False)
    assert proc.returncode == os.EX_DATAERR
    assert "refusing to load global" in proc.stderr and "mkdir" in proc.stderr, proc.stderr
    assert not marker.exists()


@pytest.mark.interpreter  # enums pickled by name, as 3.11.0-3.11.4 write them
def test_metadata_with_enums_by_name_merges_the_same(dcp_root, tmp_path):
    """The .metadata as Python 3.11.0-3.11.4 write it (enum members as getattr(EnumClass, NAME)), two ranks."""
    folder = Path(shutil.copytree(dcp_root / "plain", tmp_path / "by_name"))
    repickle(folder / ".metadata")
    run_merger("merge", "--local_dir", folder, "--target_dir", tmp_path / "out", nproc=2)
    assert_same_weights(tmp_path / "out", dcp_root / "reference", torch.bfloat16)


@pytest.mark.parametrize("damage", ["truncated", "chunk overwritten"])
def test_damaged_chunk_file_names_the_file(damage, dcp_root, tmp_path):
    """Chunks are viewed in the mapped .distcp file: a short file or bytes that are no torch.save blob give one
    clear line naming the file, and nothing at the target."""
    folder = tmp_path / "damaged"
    shutil.copytree(dcp_root / "plain", folder)
    victim = sorted(folder.glob("__*.distcp"))[-1]
    data = bytearray(victim.read_bytes())
    if damage == "truncated":
        victim.write_bytes(data[: len(data) // 2])
    else:
        data[: len(data) // 2] = bytes(len(data) // 2)
        victim.write_bytes(data)
    proc = run_merger("merge", "--local_dir", folder, "--target_dir", tmp_path / "out", check=False)
    assert proc.returncode == os.EX_DATAERR
    errors = [line for line in proc.stderr.splitlines() if line.startswith("merger: error:")]
    assert len(errors) == 1 and errors[0].endswith(str(victim)), proc.stderr
    assert ("truncated" if damage == "truncated" else "not a torch.save blob") in errors[0]
    assert not (tmp_path / "out").exists()
    if damage == "truncated":  # shorter than .metadata says: plain inspect, reading no chunk, names it as well
        proc = run_merger("inspect", "--local_dir", folder, check=False)
        said = [line for line in proc.stderr.splitlines() if line.startswith("merger:")]
        assert proc.returncode == os.EX_DATAERR and said == errors, proc.stderr


@pytest.mark.parametrize("dtype", ["bfloat16", "keep"])
def test_flipped_bit_in_a_chunk_fails_its_checksum(dcp_root, tmp_path, dtype):
    """A bit flipped inside a chunk's tensor data is caught by the CRC-32 of the chunk's torch.save record: read
    into memory and cast (bfloat16), or copied into the output inside the kernel and read back there (keep)."""
    import io

    from torch.distributed.checkpoint import FileSystemReader

    folder = tmp_path / "damaged"
    shutil.copytree(dcp_root / "plain", folder)
    storage = FileSystemReader(str(folder)).read_metadata().storage_data
    index, info = max(storage.items(), key=lambda item: item[1].length)  # located by torch's own reader
    victim = folder / info.relative_path
    blob = victim.read_bytes()[info.offset:info.offset + info.length]
    flip_bit_in_tensor(victim, torch.load(io.BytesIO(blob), weights_only=True))
    proc = run_merger("merge", "--local_dir", folder, "--target_dir", tmp_path / "out", "--dtype", dtype,
                      check=False)
    assert proc.returncode == os.EX_DATAERR
    error = single_error_line(proc.stderr)
    assert f"checksum mismatch in tensor {index.fqn}" in error and error.endswith(str(victim)), error
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.merger-partial").exists()
    # found before a merge too, reading the chunks' blobs alone
    proc = run_merger("inspect", "--local_dir", folder, "--check", check=False)
    assert proc.returncode == os.EX_DATAERR and single_error_line(proc.stderr) == error, proc.stderr


@pytest.mark.parametrize("how", ["named in .metadata", "linked"])
def test_a_chunk_file_outside_the_folder_is_refused(how, dcp_root, tmp_path):
    """`.metadata` names each chunk's file relative to the folder: a name leading out of it, or a chunk file that
    is a link out of it, stops the merge at once, naming `.metadata`."""
    folder = Path(shutil.copytree(dcp_root / "plain", tmp_path / "ckpt"))
    victim = sorted(folder.glob("__*.distcp"))[-1]
    outside = victim.rename(tmp_path / "outside.distcp")
    if how == "linked":
        victim.symlink_to(outside)
        name = victim.name
    else:
        name = "../outside.distcp"
        metadata_naming(folder, victim.name, name)
    proc = run_merger("merge", "--local_dir", folder, "--target_dir", tmp_path / "out", check=False)
    assert proc.returncode == 1
    error = single_error_line(proc.stderr)
    assert f"names '{name}', which lies outside the checkpoint folder" in error, error
    assert error.endswith(str(folder / ".metadata")) and not (tmp_path / "out").exists()


def test_torchtitan_llama_to_hf(torchtitan_root, tmp_path):
    """Names and wq/wk permutation equal torchtitan's own to_hf of the unsharded model, bit for bit."""
    merge_in_process(torchtitan_root / "checkpoint" / "step-1", tmp_path / "out",
                     "--hf_model_config_path", torchtitan_root / "hf", "--dtype", "keep")
    assert_same_weights(tmp_path / "out", torchtitan_root / "reference", None)


def test_rotary_permute_matches_torchtitan_and_hf_rotary():
    """Attention scores of torchtitan's complex RoPE on the original wq/wk equal those of HF's rotate-half RoPE
    on the permuted weights, for query and grouped kv heads."""
    need_torchtitan()
    import transformers
    from torchtitan.models.common import ComplexRoPE
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from merger.mapping.transforms import rotary_permute

    heads, kv_heads, head_dim, dim, seq = 4, 2, 8, 32, 6
    torch.manual_seed(0)
    wq, wk = torch.randn(heads * head_dim, dim) * 0.1, torch.randn(kv_heads * head_dim, dim) * 0.1
    x = torch.randn(1, seq, dim)

    q, k = (x @ wq.T).view(1, seq, heads, head_dim), (x @ wk.T).view(1, seq, kv_heads, head_dim)
    rope = ComplexRoPE.Config(dim=head_dim, max_seq_len=16, theta=10000.0, scaling="none").build()
    tq, tk = ComplexRoPE.apply_rotary_emb(q, k, rope._reshape_cache(q))
    titan = torch.einsum("bshd,bthd->bhst", tq, tk.repeat_interleave(heads // kv_heads, 2))

    config = transformers.LlamaConfig(hidden_size=dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      rope_theta=10000.0)
    hq = (x @ rotary_permute(wq, heads).T).view(1, seq, heads, head_dim).transpose(1, 2)
    hk = (x @ rotary_permute(wk, kv_heads).T).view(1, seq, kv_heads, head_dim).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(seq)[None])
    hq, hk = apply_rotary_pos_emb(hq, hk, cos, sin)
    hf = torch.einsum("bhsd,bhtd->bhst", hq, hk.repeat_interleave(heads // kv_heads, 1))

    torch.testing.assert_close(hf, titan, atol=1e-5, rtol=1e-5)
    unpermuted = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    wrong = torch.einsum("bhsd,bhtd->bhst", unpermuted[0], unpermuted[1].repeat_interleave(heads // kv_heads, 1))
    assert not torch.allclose(wrong, titan, atol=1e-3)  # the permutation is what makes them agree
