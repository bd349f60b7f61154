"""DCP checkpoints saved with FileSystemWriter(serialization_format=SAFETENSORS): chunks found through each
.distcp file's safetensors header, since .metadata's byte ranges are placeholders in that format; and the
unconsolidated output of torch's HuggingFaceStorageWriter(save_distributed=True), which has no .metadata at all.

Written once per session by tests/writers/dcp_safetensors_checkpoint.py (FSDP2 + dcp.save, 2 gloo ranks).
Oracle: the model's own save_pretrained output, bit for bit.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from merger.cli import main as merger_main
from tests.helpers.processes import run_merger, run_merger_leaving_no_thread, run_writer
from tests.helpers.weights import assert_same_weights

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def st_root(tmp_path_factory) -> Path:
    """plain/ (model.state_dict()), checkpoint-1/pytorch_model_fsdp_0 (nested, optimizer, 2 files per rank),
    hf_sharded/ (HuggingFaceStorageWriter), hf/, reference/."""
    root = tmp_path_factory.mktemp("dcp_safetensors")
    run_writer("dcp_safetensors_checkpoint.py", "--out", root, nproc=2)
    return root


def test_safetensors_format_one_process(st_root, tmp_path):
    assert merger_main(["merge", "--local_dir", str(st_root / "plain"), "--target_dir", str(tmp_path / "out"),
                        "--dtype", "keep"]) == 0
    assert_same_weights(tmp_path / "out", st_root / "reference", None)


def test_safetensors_format_nested_with_optimizer_torchrun(st_root, tmp_path):
    """Raw-byte optimizer entries sit before the safetensors part of some files; 3 merge ranks, 4 files.
    Reading DCP imports torch modules that once kept the process group alive into interpreter finalization,
    where a rank with nothing to write aborted now and then after the merge: no rank may leave a thread."""
    run_merger_leaving_no_thread("merge", "--local_dir", st_root / "checkpoint-1", "--target_dir", tmp_path / "out",
                                 "--hf_model_config_path", st_root / "hf", "--dtype", "keep", "--device", "cpu",
                                 nproc=3)
    assert_same_weights(tmp_path / "out", st_root / "reference", None)


def test_safetensors_chunks_disagreeing_with_metadata(st_root, tmp_path, capsys):
    """A file swapped for another rank's, or cut short: a clear error naming the file, and no output."""
    swapped = tmp_path / "swapped"
    shutil.copytree(st_root / "plain", swapped)
    shutil.copy(st_root / "plain" / "__1_0.distcp", swapped / "__0_0.distcp")
    assert merger_main(["merge", "--local_dir", str(swapped), "--target_dir", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert "merger: error: tensor " in err and ".metadata" in err and err.rstrip().endswith("__0_0.distcp"), err

    cut = tmp_path / "cut"
    shutil.copytree(st_root / "plain", cut)
    data = (cut / "__1_0.distcp").read_bytes()
    (cut / "__1_0.distcp").write_bytes(data[:-100])
    assert merger_main(["merge", "--local_dir", str(cut), "--target_dir", str(tmp_path / "b")]) == os.EX_DATAERR
    err = capsys.readouterr().err
    assert "merger: error: safetensors data section" in err and "__1_0.distcp" in err, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_hf_storage_writer_shards_torchrun(st_root, tmp_path, capsys):
    """Shapes from the shard headers alone; 3 merge ranks for 2 shard files. A missing shard is an error."""
    run_merger("merge", "--local_dir", st_root / "hf_sharded", "--target_dir", tmp_path / "out",
               "--hf_model_config_path", st_root / "hf", "--dtype", "keep", "--device", "cpu", nproc=3)
    assert_same_weights(tmp_path / "out", st_root / "reference", None)

    partial = tmp_path / "partial"
    shutil.copytree(st_root / "hf_sharded", partial)
    (partial / "shard-00001-model-00001-of-00001.safetensors").unlink()
    assert merger_main(["merge", "--local_dir", str(partial), "--target_dir", str(tmp_path / "a"),
                        "--hf_model_config_path", str(st_root / "hf")]) == os.EX_NOINPUT
    assert "shard files of saving ranks [1] are missing" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_inspect_check_finds_a_truncated_chunk_file(st_root, tmp_path, capsys):
    """`inspect` reads `.metadata` alone and sees nothing wrong with a chunk file cut short; `--check` reads each
    file's safetensors header and bounds, and names it."""
    folder = Path(shutil.copytree(st_root / "plain", tmp_path / "plain"))
    assert merger_main(["inspect", "--local_dir", str(folder), "--check"]) == 0
    assert "all fine" in capsys.readouterr().out

    victim = folder / "__1_0.distcp"
    victim.write_bytes(victim.read_bytes()[:-5])
    assert merger_main(["inspect", "--local_dir", str(folder)]) == 0
    capsys.readouterr()
    assert merger_main(["inspect", "--local_dir", str(folder), "--check"]) == os.EX_DATAERR
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("merger: error:")]
    assert len(errors) == 1 and errors[0].endswith(str(victim)) and "all fine" not in out, err
