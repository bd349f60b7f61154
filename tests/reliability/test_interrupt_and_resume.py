"""Ctrl-C keeps the partial merge and says how to go on; --resume reuses the finished files, unless the source
changed, and counts only the bytes still to write against free space.

Every case starts from a real FSDP2 checkpoint (conftest's fsdp_checkpoint: fully_shard + torch.save under
gloo) copied into the test's folder (tests/reliability/conftest.py's `ckpt`) and damaged there as the case
needs. The oracles are the model's own weights (save_pretrained), hashes of the files before and after, and
the processes' exit codes; single-process cases call the CLI in this process to stay fast.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from merger.cli import main
from tests.helpers.files import assert_same_files, block_crc32, snapshot, takes_o_direct
from tests.helpers.in_process import single_error_line
from tests.helpers.paths import HELPERS, ROOT
from tests.helpers.processes import run, run_merger, start_merger, subprocess_env
from tests.helpers.reliability import RANK0, SMALL, WORLD, kill_rank_mid_merge, wait_paused
from tests.helpers.weights import assert_same_weights

pytestmark = pytest.mark.slow


def _kept_and_resumed(ckpt: Path, reference: Path, out: Path, stage: Path, err: str) -> None:
    """A merge stopped by Ctrl-C kept its staging folder and said how to go on; a rerun without --resume or
    --overwrite leaves it alone, and --resume finishes the model."""
    assert stage.is_dir() and (stage / "merge_manifest.json").is_file() and not out.exists()
    kept = (f"; the partial merge is kept in {stage}: rerun with --resume to continue it, or --overwrite to start "
            f"over")
    assert any(line.startswith("merger: error:") and line.endswith(kept) for line in err.splitlines()), err
    before = snapshot(stage)
    again = run_merger("merge", "--local_dir", ckpt, "--target_dir", out, *SMALL, check=False)
    assert again.returncode == os.EX_CANTCREAT and single_error_line(again.stderr) == (
        f"merger: error: a partial merge is kept in {stage}: pass --resume to continue it, or --overwrite to "
        f"start over, {out}")
    assert snapshot(stage) == before and not out.exists()
    resumed = run_merger("merge", "--local_dir", ckpt, "--target_dir", out, *SMALL, "--resume")
    assert "reusing" in resumed.stderr
    assert_same_weights(out, reference, torch.bfloat16)


@pytest.mark.interpreter  # SIGINT becomes KeyboardInterrupt by the interpreter's own handler
def test_ctrl_c_keeps_the_partial_merge_and_says_so(ckpt, reference, tmp_path):
    pause = tmp_path / "paused"
    out, stage = tmp_path / "out", tmp_path / ".out.merger-partial"
    env = {"MERGER_TEST_PAUSE_AFTER_BATCH": "3", "MERGER_TEST_PAUSE_FILE": str(pause)}
    proc = start_merger("merge", "--local_dir", ckpt, "--target_dir", out, *SMALL, env=env)
    wait_paused([proc], pause, [0])
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert [line for line in err.splitlines() if line.startswith("merger: error:")] == [
        f"merger: error: interrupted by SIGINT; the partial merge is kept in {stage}: rerun with --resume to "
        f"continue it, or --overwrite to start over"], err
    _kept_and_resumed(ckpt, reference, out, stage, err)


def test_ctrl_c_at_launcher_local_reaches_every_rank_as_sigint(ckpt, reference, tmp_path):
    # The terminal's Ctrl-C goes to the launcher (its ranks run in sessions of their own): each rank must learn
    # it as SIGINT, once, and not be terminated in the middle of its cleanup.
    pause = tmp_path / "paused"
    out, stage = tmp_path / "out", tmp_path / ".out.merger-partial"
    env = {"MERGER_TEST_PAUSE_AFTER_BATCH": "3", "MERGER_TEST_PAUSE_FILE": str(pause)}
    launcher = subprocess.Popen([sys.executable, HELPERS / "paused_launcher.py", "local", "--nproc",
                                 str(WORLD), "--", "merge", "--local_dir", ckpt, "--target_dir", out, *SMALL],
                                cwd=ROOT, env=subprocess_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    wait_paused([launcher], pause, range(WORLD))
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=60)
    errors = sorted(line for line in err.splitlines() if line.startswith("merger: error:"))
    assert launcher.returncode == 130 and "SIGTERM" not in err, err
    assert errors == [f"merger: error: interrupted by SIGINT (rank 0); the partial merge is kept in {stage}: rerun "
                      f"with --resume to continue it, or --overwrite to start over",
                      "merger: error: interrupted by SIGINT (rank 1)"], err
    _kept_and_resumed(ckpt, reference, out, stage, err)


# Options that change how a merge runs, not what it writes: a resume with them reuses the finished files all the same.
RUNTIME_FLAGS = {"no flags": [], "verify, summary, explicit backend": ["--verify", "--summary_json", "SUMMARY",
                                                                       "--backend", "fsdp", "--dist_timeout", "300"]}


@pytest.mark.parametrize("flags", list(RUNTIME_FLAGS))
def test_resume_after_a_killed_rank_reuses_finished_files(flags, ckpt, reference, tmp_path):
    out = tmp_path / "out"
    extra = [str(tmp_path / "summary.json") if f == "SUMMARY" else f for f in RUNTIME_FLAGS[flags]]
    stage = tmp_path / ".out.merger-partial"
    proc = kill_rank_mid_merge(ckpt, out, tmp_path, "--keep-partial")[0]
    assert proc.returncode != 0 and not out.exists() and stage.is_dir(), proc.stderr
    manifest = json.loads((stage / "merge_manifest.json").read_text())
    finished = {n for n, f in manifest["output_files"].items() if all(f["crc32_blocks"])}
    assert finished and finished != set(manifest["output_files"]), manifest  # some files done, not all
    before = {n: (os.stat(stage / n).st_ino, os.stat(stage / n).st_mtime_ns) for n in finished}

    # Resumed by 3 ranks, not 2: they verify the finished files between them, and the bytes do not depend on M.
    resumed = run_merger("merge", "--local_dir", ckpt, "--target_dir", out, *SMALL, "--resume", *extra, nproc=3)
    assert f"reusing {len(finished)} of {len(manifest['output_files'])} output files" in resumed.stderr
    assert_same_weights(out, reference, torch.bfloat16)
    assert {n: (os.stat(out / n).st_ino, os.stat(out / n).st_mtime_ns) for n in finished} == before
    final = json.loads((out / "merge_manifest.json").read_text())
    assert final["complete"] is True
    for name, info in final["output_files"].items():
        assert info["crc32_blocks"] == block_crc32(out / name, final["checksum_block_bytes"])


def _finished(manifest: dict) -> set[str]:
    """The output files whose every block checksum the manifest records."""
    return {name for name, info in manifest["output_files"].items() if all(info["crc32_blocks"])}


def test_a_block_checksum_enters_the_manifest_only_once_its_bytes_are_in_the_file(fsdp_checkpoint, tmp_path):
    """Issue #52. One rank writes pieces of 0.5-1 MiB (hidden 512) past the page cache into 1 MB shards with 64 KiB
    checksum blocks, every direct write held back 50 ms on its thread (a slow disk: tests/helpers/small_blocks_merger.py),
    so that written pieces queue up behind the disk. Killed with SIGKILL as soon as the manifest in the staging folder
    names every block checksum of two files (the first holds the embedding, whose pieces are too small to go direct;
    the second is written direct), the manifest may record only bytes that are in the files: each block CRC it holds
    is zlib's over that block as it lies on disk. --resume then reuses every file the manifest names finished,
    and writes the same bytes as a merge never interrupted. Before the fix the CRC of a direct write, taken when the
    write was handed over, could reach the manifest while the write still waited its turn: the killed merge left
    files that contradicted their checksums, and --resume reused none of them."""
    actor, _ = fsdp_checkpoint("llama", 2, extra=("--hidden", "512"))
    if not takes_o_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT writes")
    block = 64 << 10
    out, clean, stage = tmp_path / "out", tmp_path / "clean", tmp_path / ".out.merger-partial"
    args = ["merge", "--local_dir", str(actor), "--target_dir", str(out), "--dtype", "bfloat16",
            "--max_shard_size", "1MB", "--device", "cpu"]
    small_blocks = [sys.executable, str(HELPERS / "small_blocks_merger.py")]
    env = {"MERGER_TEST_CHECKSUM_BLOCK": str(block)}
    proc = subprocess.Popen(small_blocks + args, cwd=ROOT, env=subprocess_env({**env, "MERGER_TEST_SLOW_DIRECT_WRITES":
                                                                                "0.05"}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            try:
                if len(_finished(json.loads((stage / "merge_manifest.json").read_text()))) >= 2:
                    break
            except (FileNotFoundError, json.JSONDecodeError):  # not written yet (replaced atomically once it is)
                pass
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert not out.exists()

    manifest = json.loads((stage / "merge_manifest.json").read_text())
    finished, files = _finished(manifest), manifest["output_files"]
    assert finished and finished != set(files) and manifest["checksum_block_bytes"] == block, manifest
    for name, info in files.items():
        on_disk = block_crc32(stage / name, block)
        recorded = {k: crc for k, crc in enumerate(info["crc32_blocks"]) if crc is not None}
        assert recorded == {k: on_disk[k] for k in recorded}, name

    resumed = run(small_blocks + args + ["--resume"], env=env)
    assert f"reusing {len(finished)} of {len(files)} output files" in resumed.stderr, resumed.stderr
    assert main([*args[:4], str(clean), *args[5:]]) == 0
    assert_same_files(out, clean)


def _newer(ckpt: Path, other: Path) -> Path:
    """Retrained: the file's mtime moves on."""
    st = os.stat(ckpt / RANK0)
    os.utime(ckpt / RANK0, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    return ckpt


def _rewritten_mtime_kept(ckpt: Path, other: Path) -> Path:
    """Other contents of the same size written over the file, its mtime set back: only the ctime tells."""
    st = os.stat(ckpt / RANK0)
    (ckpt / RANK0).write_bytes((other / RANK0).read_bytes())
    os.utime(ckpt / RANK0, ns=(st.st_atime_ns, st.st_mtime_ns))
    return ckpt


def _copy_elsewhere_mtimes_kept(ckpt: Path, other: Path) -> Path:
    """Another checkpoint with the same file names, sizes and mtimes, in another folder."""
    copy = Path(shutil.copytree(other, ckpt.parent / "other_actor"))
    for f in copy.iterdir():
        if f.is_file():
            st = os.stat(ckpt / f.name)
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    return copy


CHANGES = {"newer mtime": _newer, "rewritten, mtime kept": _rewritten_mtime_kept,
           "copy elsewhere, mtimes kept": _copy_elsewhere_mtimes_kept}


@pytest.mark.parametrize("change", list(CHANGES))
def test_changed_source_invalidates_resume(change, ckpt, fsdp_checkpoint, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="merger")
    other, other_reference = fsdp_checkpoint("llama", WORLD, extra=("--seed", "1"))  # same shapes, other values
    assert (other / RANK0).stat().st_size == (ckpt / RANK0).stat().st_size
    out = tmp_path / "out"
    stage = tmp_path / ".out.merger-partial"
    kill_rank_mid_merge(ckpt, out, tmp_path, nproc=1, victim=0)  # SIGKILL leaves the staging folder behind
    manifest = json.loads((stage / "merge_manifest.json").read_text())
    finished = {n for n, f in manifest["output_files"].items() if all(f["crc32_blocks"])}
    assert finished
    before = {n: (os.stat(stage / n).st_ino, os.stat(stage / n).st_mtime_ns) for n in finished}
    source = CHANGES[change](ckpt, other)

    assert main(["merge", "--local_dir", str(source), "--target_dir", str(out), *SMALL, "--resume"]) == 0
    assert "source files changed" in caplog.text or "source folder changed" in caplog.text
    after = {n: (os.stat(out / n).st_ino, os.stat(out / n).st_mtime_ns) for n in finished}
    assert all(after[n] != before[n] for n in finished)  # every file written again
    if source != ckpt:
        assert_same_weights(out, other_reference, torch.bfloat16)  # the other checkpoint's model, not a mix


def _as_an_older_merger_wrote_it(stage: Path, manifest: dict) -> dict:
    """The manifest as mergers before CRC-32 wrote it: no `checksum_algorithm`, and per file `header_sha256`
    (of the bytes before the first tensor, by the safetensors header's own length) and `sha256_blocks`, right
    for the bytes of every finished file."""
    block = manifest["checksum_block_bytes"]
    files = {}
    for name, info in manifest["output_files"].items():
        data = (stage / name).read_bytes()
        header = data[:8 + struct.unpack("<Q", data[:8])[0]]
        files[name] = {"size": info["size"], "header_sha256": hashlib.sha256(header).hexdigest(),
                       "sha256_blocks": [hashlib.sha256(data[start:start + block]).hexdigest() if all(
                           info["crc32_blocks"]) else None for start in range(0, len(data), block)]}
    return {**{k: v for k, v in manifest.items() if k != "checksum_algorithm"}, "output_files": files}


def test_resume_reuses_nothing_from_an_older_mergers_sha256_manifest(ckpt, reference, tmp_path, caplog):
    """A partial merge kept by a merger that recorded sha256 checksums, its finished files intact: --resume
    says in one line why it reuses none of them, and writes every file again."""
    caplog.set_level(logging.INFO, logger="merger")
    out, stage = tmp_path / "out", tmp_path / ".out.merger-partial"
    kill_rank_mid_merge(ckpt, out, tmp_path, nproc=1, victim=0)  # SIGKILL leaves the staging folder behind
    manifest = json.loads((stage / "merge_manifest.json").read_text())
    finished = {n for n, f in manifest["output_files"].items() if all(f["crc32_blocks"])}
    assert finished
    (stage / "merge_manifest.json").write_text(json.dumps(_as_an_older_merger_wrote_it(stage, manifest)))
    before = {n: (os.stat(stage / n).st_ino, os.stat(stage / n).st_mtime_ns) for n in finished}

    assert main(["merge", "--local_dir", str(ckpt), "--target_dir", str(out), *SMALL, "--resume"]) == 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("merger: --resume: not reusing")]
    assert said == [f"merger: --resume: not reusing {stage}: its checksums are sha256 (an older merger's), "
                    f"not crc32"], caplog.text
    assert f"reusing 0 of {len(manifest['output_files'])} output files" in caplog.text
    after = {n: (os.stat(out / n).st_ino, os.stat(out / n).st_mtime_ns) for n in finished}
    assert all(after[n] != before[n] for n in finished)  # every file written again
    assert_same_weights(out, reference, torch.bfloat16)
    final = json.loads((out / "merge_manifest.json").read_text())
    assert final["checksum_algorithm"] == "crc32" and "sha256_blocks" not in json.dumps(final)


def test_resume_counts_only_the_bytes_still_to_write_against_free_space(ckpt, tmp_path):
    """After a disk-full failure the kept staging folder's unfinished files fill the disk; --resume writes them
    anew, so their space counts as free (it used to refuse the resume that would fit)."""
    from merger.engine.dist import Group
    from merger.api.pipeline import prepare
    from merger.options import MergeOptions
    from merger.output.files import prepare_files
    from merger.output.safetensors_layout import file_sizes

    plan = prepare(MergeOptions(local_dir=ckpt, max_shard_size=20_000), Group()).plan
    assert len(plan.files) > 2
    sizes = file_sizes(plan.files)
    total = sum(sizes.values())
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    size = sum(-(-n // 4096) * 4096 for n in sizes.values()) + 2 * 4096  # every file, two pages to spare
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        stage = mnt / ".model.merger-partial"
        stage.mkdir()
        for f in plan.files:  # every file written to its full size, none finished but the first
            (stage / f.name).write_bytes(os.urandom(sizes[f.name]))
        st = os.statvfs(mnt)
        assert st.f_bavail * st.f_frsize < total - sizes[plan.files[0].name]  # the old check would refuse
        keep = plan.files[0].name
        kept = (stage / keep).read_bytes()
        prepare_files(stage, plan, keep=frozenset({keep}))
        assert (stage / keep).read_bytes() == kept
        assert all((stage / name).stat().st_size == n for name, n in sizes.items())
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
