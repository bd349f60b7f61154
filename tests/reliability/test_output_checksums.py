"""The output's block checksums: every rank hashes its share of the finished files, each block once every
tensor in it is written, and --resume verifies the blocks on every rank.

Every case starts from a real FSDP2 checkpoint (conftest's fsdp_checkpoint: fully_shard + torch.save under
gloo) copied into the test's folder (tests/reliability/conftest.py's `ckpt`) and damaged there as the case
needs. The oracles are the model's own weights (save_pretrained), hashes of the files before and after, and
the processes' exit codes; single-process cases call the CLI in this process to stay fast.
"""
from __future__ import annotations

import json
import mmap
import struct
import sys
import time
from pathlib import Path

import pytest
import torch

from merger.cli import main
from merger.output import direct_writes
from merger.output.resume import CHECKSUM_BLOCK, deal_blocks
from tests.helpers.files import block_crc32, cached_pages, takes_o_direct
from tests.helpers.paths import HELPERS
from tests.helpers.processes import run, run_merger, torchrun_cmd
from tests.helpers.reliability import SMALL
from tests.helpers.weights import assert_same_weights

pytestmark = pytest.mark.slow

SMALL_BLOCKS_MERGER = HELPERS / "small_blocks_merger.py"
PAGE = mmap.PAGESIZE


def test_every_rank_checksums_its_share_of_the_files(ckpt, tmp_path):
    """3 ranks share the read-back checksums; rank 0's manifest ends up with the CRC-32 of every 256 MiB block
    of every file (one block each here) as zlib computes it over the finished files."""
    out = tmp_path / "out"
    run_merger("merge", "--local_dir", ckpt, "--target_dir", out, *SMALL, nproc=3)
    manifest = json.loads((out / "merge_manifest.json").read_text())
    files = manifest["output_files"]
    assert len(files) > 3 and manifest["checksum_block_bytes"] == 256 << 20
    assert {name: info["crc32_blocks"] for name, info in files.items()} == {
        name: block_crc32(out / name, 256 << 20) for name in files}


@pytest.mark.parametrize("as_written", [True, False], ids=["crcs as written", "read back"])
def test_one_file_is_hashed_by_every_rank(as_written, ckpt, tmp_path):
    """One output file, 2 ranks, 2000-byte checksum blocks (tests/helpers/small_blocks_merger.py sets merger's block
    size; the real one is 256 MiB): each block's CRC-32 is zlib's over those bytes of the finished file. Combined
    from the CRCs the ranks took as they wrote, no byte of the output is read back; with those CRCs refused
    (MOST_PER_BLOCK 0), each rank read back and hashed half of the file, give or take a block."""
    out, hashed, block = tmp_path / "out", tmp_path / "hashed", 2000
    env = {"MERGER_TEST_CHECKSUM_BLOCK": str(block), "MERGER_TEST_HASHED": str(hashed)}
    if not as_written:
        env["MERGER_TEST_MOST_PER_BLOCK"] = "0"
    run(torchrun_cmd(2) + [str(SMALL_BLOCKS_MERGER), "merge", "--local_dir", str(ckpt), "--target_dir", str(out),
                           "--max_inflight", "1"], env=env)
    manifest = json.loads((out / "merge_manifest.json").read_text())
    assert list(manifest["output_files"]) == ["model.safetensors"] and manifest["checksum_block_bytes"] == block
    size = (out / "model.safetensors").stat().st_size
    assert size > 10 * block
    assert manifest["output_files"]["model.safetensors"]["crc32_blocks"] == block_crc32(out / "model.safetensors",
                                                                                         block)
    per_rank = [int(Path(f"{hashed}.{rank}").read_text()) for rank in range(2)]
    if as_written:
        assert per_rank == [0, 0]
    else:
        assert sum(per_rank) == size and abs(per_rank[0] - per_rank[1]) <= block, per_rank


@pytest.mark.parametrize("ranks", [1, 2])
def test_ranks_of_a_host_write_past_the_page_cache_and_checksum_what_they_wrote(ranks, fsdp_checkpoint, tmp_path):
    """A verl checkpoint with 0.5-2 MiB pieces (hidden 512) merged to bf16 into one file by 1 rank, or by 2 ranks
    of this host, 1 MiB checksum blocks: the weights are the model's own, every block's CRC-32 is zlib's over
    the finished file, no byte was read back to get them, and the pieces' middles never entered the page cache
    (written with O_DIRECT: mincore, right after the merge, finds those pages uncached). A rank alone writes them
    from its batch buffers, ranks that share the host through bounce buffers as well."""
    actor, reference = fsdp_checkpoint("llama", 2, extra=("--hidden", "512"))
    out, hashed, block = tmp_path / "out", tmp_path / "hashed", 1 << 20
    env = {"MERGER_TEST_CHECKSUM_BLOCK": str(block), "MERGER_TEST_HASHED": str(hashed)}
    start = torchrun_cmd(ranks) if ranks > 1 else [sys.executable]
    run(start + [str(SMALL_BLOCKS_MERGER), "merge", "--local_dir", str(actor), "--target_dir", str(out),
                 "--dtype", "bfloat16", "--max_shard_size", "1GB", "--device", "cpu"], env=env)
    file = out / "model.safetensors"
    cached = cached_pages(file)
    if all(cached):
        assert not takes_o_direct(tmp_path), "every page of the output went through the page cache"
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT writes")
    # Each tensor's rows are split between the 2 source ranks: the middle of each half, as pages, skipped the cache.
    middles = [page for a, b in _halves(file) if b - a >= 1 << 18
               for page in range(-(-a // PAGE) + 1, b // PAGE - 1)]
    assert middles and not any(cached[page] for page in middles)
    manifest = json.loads((out / "merge_manifest.json").read_text())
    assert manifest["output_files"][file.name]["crc32_blocks"] == block_crc32(file, block)
    assert [int(Path(f"{hashed}.{rank}").read_text()) for rank in range(ranks)] == [0] * ranks
    assert_same_weights(out, reference, torch.bfloat16)


def test_a_batch_buffer_is_read_into_again_only_once_its_direct_writes_are_done(fsdp_checkpoint, tmp_path,
                                                                                monkeypatch):
    """One rank writes the pieces of each batch straight from its batch buffers, and the buffers of batch k are read
    into again for batch k + 2. With every direct write held back 20 ms on its thread (a slow disk) and 1 MiB
    batches (many reuses), the merged weights are still the model's own: no buffer was refilled under a write."""
    actor, reference = fsdp_checkpoint("llama", 2, extra=("--hidden", "512"))
    if not takes_o_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT writes")
    slow, written = direct_writes._pwrite_all, []

    def slow_disk(fd, path, data, at):
        time.sleep(0.02)
        written.append(len(data))
        slow(fd, path, data, at)

    monkeypatch.setattr(direct_writes, "_pwrite_all", slow_disk)
    out = tmp_path / "out"
    assert main(["merge", "--local_dir", str(actor), "--target_dir", str(out), "--dtype", "bfloat16",
                 "--max_inflight", "1MiB", "--device", "cpu"]) == 0
    assert len(written) > 20
    assert_same_weights(out, reference, torch.bfloat16)


def _halves(file: Path) -> list[tuple[int, int]]:
    """The byte ranges of each tensor's two halves by rows (what each of 2 ranks writes of an FSDP-sharded tensor)."""
    halves = []
    for a, b in _tensor_spans(file).values():
        mid = a + (b - a) // 2
        halves += [(a, mid), (mid, b)]
    return halves


@pytest.mark.parametrize("sizes, world", [
    ([10 * CHECKSUM_BLOCK + 3], 2), ([10 * CHECKSUM_BLOCK + 3], 3),  # one file
    ([CHECKSUM_BLOCK + 1] * 8, 2),  # every file a full block and a 1-byte one: round-robin would split 8:1
    ([CHECKSUM_BLOCK // 2] * 5 + [7 * CHECKSUM_BLOCK], 4), ([3 * CHECKSUM_BLOCK] * 2, 8)])  # ranks to spare
def test_checksum_blocks_are_dealt_evenly(sizes, world):
    """Every block of every file to exactly one rank, and no rank more than one block's bytes ahead of any other."""
    shares = deal_blocks(list(enumerate(sizes)), CHECKSUM_BLOCK, world)
    blocks = [(i, k) for i, size in enumerate(sizes) for k in range(-(-size // CHECKSUM_BLOCK))]
    assert sorted(pair for share in shares for pair in share) == blocks
    nbytes = [sum(min(CHECKSUM_BLOCK, sizes[i] - k * CHECKSUM_BLOCK) for i, k in share) for share in shares]
    assert sum(nbytes) == sum(sizes) and max(nbytes) - min(nbytes) <= CHECKSUM_BLOCK, nbytes
    assert sum(1 for share in shares if share) == min(world, len(blocks))


def _tensor_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's byte range in a safetensors file, read from its header as the format defines it."""
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    return {name: (8 + length + info["data_offsets"][0], 8 + length + info["data_offsets"][1])
            for name, info in header.items() if name != "__metadata__"}


# How a block's bytes become known written: this rank wrote them, every rank did (a batch confirmed at a sync
# point, on one host), or every rank did and the file's last batch is confirmed (across hosts).
WRITTEN = {"written here": (True, True), "confirmed, one host": (False, True), "confirmed, across hosts": (False, False)}


@pytest.mark.parametrize("how", list(WRITTEN))
def test_a_block_is_hashed_once_every_tensor_in_it_is_written(how, ckpt, tmp_path, monkeypatch):
    """In process, with 1000-byte blocks, over a finished one-file merge: once the first half of the batches
    are known written, exactly the blocks whose every tensor (by the file's own header) they wrote have a
    checksum, zlib's; the rest get theirs when the last batch is."""
    from merger.engine.dist import Group
    from merger.api.pipeline import prepare
    from merger.options import MergeOptions
    from merger.output import resume
    from merger.output.files import FileSink

    own, one_host = WRITTEN[how]
    out, block = tmp_path / "out", 1000
    assert main(["merge", "--local_dir", str(ckpt), "--target_dir", str(out), "--max_inflight", "1"]) == 0
    options = MergeOptions(local_dir=ckpt, max_inflight=1)
    prepared = prepare(options, Group())
    plan, file = prepared.plan, out / "model.safetensors"
    assert [f.name for f in plan.files] == [file.name] and len(plan.batches) > 4
    monkeypatch.setattr(resume, "CHECKSUM_BLOCK", block)
    manifest = resume.start_manifest(prepared.catalog, {}, options, plan, 1)
    tracker = resume.FileTracker(plan, FileSink(out, plan), Group(), out, manifest, one_host)
    half = len(plan.batches) // 2
    if own:
        for batch in plan.batches[:half]:
            for step in batch.steps:
                tracker.step_written(step)
    else:
        tracker.confirmed(half)
    tracker.wait()

    spans, size = _tensor_spans(file), file.stat().st_size
    done = {o.name for batch in plan.batches[:half] for step in batch.steps for o in plan.steps[step].outputs}
    want = block_crc32(file, block)
    inside = [{name for name, (a, b) in spans.items() if a < min(start + block, size) and b > start and b > a}
              for start in range(0, size, block)]
    # Across hosts other ranks' bytes count only once the file's last batch is confirmed: just the header's.
    ready = [names <= done if one_host else not names for names in inside]
    assert any(ready) and not all(ready) and len(want) > 20
    assert manifest.output_files[file.name].crc32_blocks == [w if r else None for w, r in zip(want, ready)]

    tracker = resume.FileTracker(plan, FileSink(out, plan), Group(), out, manifest, one_host)
    tracker.confirmed(len(plan.batches))
    tracker.wait()
    assert manifest.output_files[file.name].crc32_blocks == want


def test_resume_verifies_blocks_on_every_rank(ckpt, tmp_path, monkeypatch):
    """A finished merge with 4000-byte blocks, one bit flipped in its second block of one file and another
    file's last checksum missing: the finished model is no longer intact, and the 3 ranks' shares of the blocks
    together clear every file but those two for reuse."""
    from merger.output import resume
    from merger.output.manifest import read_manifest

    out, block = tmp_path / "out", 4000
    monkeypatch.setattr(resume, "CHECKSUM_BLOCK", block)
    assert main(["merge", "--local_dir", str(ckpt), "--target_dir", str(out), *SMALL]) == 0
    manifest = json.loads((out / "merge_manifest.json").read_text())
    files = manifest["output_files"]
    assert {n: f["crc32_blocks"] for n, f in files.items()} == {n: block_crc32(out / n, block) for n in files}
    flipped, unfinished = [n for n in files if len(files[n]["crc32_blocks"]) > 2][:2]
    merged = read_manifest(out)  # what a rerun of this very merge starts from
    assert resume.why_not_done(out, merged) is None  # --resume on the finished model: nothing to do
    data = bytearray((out / flipped).read_bytes())
    data[block + block // 2] ^= 1
    (out / flipped).write_bytes(data)
    assert resume.why_not_done(out, merged) == f"{flipped} no longer matches its checksums"
    cut = dict(files[unfinished], crc32_blocks=files[unfinished]["crc32_blocks"][:-1] + [None])
    (out / "merge_manifest.json").write_text(json.dumps(dict(manifest, output_files={**files, unfinished: cut})))

    candidates = resume.resume_candidates(out, merged)
    assert set(candidates) == set(files) - {unfinished}
    shares = [resume.verify_share(out, merged, candidates, rank, 3) for rank in range(3)]
    assert all(shares)
    assert sorted(resume.intact_files(candidates, shares)) == sorted(set(files) - {flipped, unfinished})
