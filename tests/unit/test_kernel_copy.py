"""Pieces written exactly as stored are copied from the source file into the output inside the kernel
(FileSink.copy_part with copy_file_range), and checked against their torch.save record by reading them back.

Oracles: torch's own indexing for where a piece's runs land, torch.save and torch.load for the bytes and the
record, and the kernel's own refusal to copy between two filesystems.
"""
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from merger.engine.plan import OutputFile, Runs, block_runs
from merger.errors import MergerError
from merger.output.files import FileSink
from merger.output.safetensors_layout import file_layout
from merger.safetensors_io import place_tensors
from merger.sources.file_reads import SourceReads
from merger.sources.mapped_states import MappedStates
from merger.sources.safe_load import torch_load

pytestmark = pytest.mark.unit

SHAPE = (6, 1024)  # float32: rows of 4 KiB, above MIN_RUN_BYTES
(ENTRY,) = place_tensors([("w", torch.float32, SHAPE)])
FILE = OutputFile("model.safetensors", (ENTRY,))
HEADER = file_layout(FILE).header


class _OneTensor:
    """The least of a plan FileSink writes through: one file holding one float32 tensor of SHAPE after its header."""

    def __init__(self):
        self.files = [FILE]
        self.location = {"w": (0, ENTRY)}

    def create(self, folder: Path) -> Path:
        path = folder / FILE.name
        path.write_bytes(HEADER + bytes(ENTRY.end))
        return path


SPEC = SimpleNamespace(name="w", dtype=torch.float32, shape=SHAPE)


def _piece(offsets, sizes):
    return SimpleNamespace(offsets=offsets, sizes=sizes)


@pytest.mark.parametrize("offsets,sizes", [((2, 0), (3, 1024)),  # a row block: one run
                                           ((0, 256), (6, 512))])  # a column block: a run per row
def test_a_copied_piece_lands_where_its_runs_say(tmp_path, offsets, sizes):
    whole = torch.randn(SHAPE)
    block = whole[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]].contiguous()
    source = tmp_path / "source.bin"
    source.write_bytes(b"x" * 100 + block.numpy().tobytes())  # the piece at byte 100 of its file
    plan = _OneTensor()
    out = plan.create(tmp_path)
    sink = FileSink(tmp_path, plan)
    fd = os.open(source, os.O_RDONLY)
    placed = sink.copy_part(SPEC, block_runs(SHAPE, _piece(offsets, sizes)), fd, 100, str(source))
    os.close(fd)
    sink.close()
    expected = torch.zeros(SHAPE)
    expected[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]] = block
    assert out.read_bytes() == HEADER + expected.numpy().tobytes()
    assert placed.file == str(out) and sum(size for _, size in placed.runs) == block.numel() * 4


def test_a_source_that_ends_early_is_one_clear_error(tmp_path):
    source = tmp_path / "source.bin"
    source.write_bytes(bytes(1000))  # the plan expects a whole row block of 3 x 4 KiB from byte 0
    plan = _OneTensor()
    plan.create(tmp_path)
    sink = FileSink(tmp_path, plan)
    fd = os.open(source, os.O_RDONLY)
    with pytest.raises(MergerError, match=f"source file shrank while being read: it ends before byte 12288, .*{source}$"):
        sink.copy_part(SPEC, Runs(0, 3 * 1024), fd, 0, str(source))
    os.close(fd)
    sink.close()


def test_between_filesystems_the_kernel_refuses_and_the_piece_goes_through_memory(tmp_path, other_filesystem):
    source = other_filesystem / "source.bin"
    source.write_bytes(bytes(3 * 4096))
    plan = _OneTensor()
    out = os.open(plan.create(tmp_path), os.O_WRONLY)
    fd = os.open(source, os.O_RDONLY)
    try:
        os.copy_file_range(fd, out, 16, 0, 0)
        pytest.skip("this kernel copies between tmpfs and the test's filesystem: nothing to fall back from")
    except OSError:
        pass
    finally:
        os.close(out)
    sink = FileSink(tmp_path, plan)
    assert sink.copy_part(SPEC, Runs(0, 3 * 1024), fd, 0, str(source)) is None
    assert sink.kernel_copies is False  # later pieces go through memory at once
    os.close(fd)
    sink.close()


def _saved(tmp_path: Path, damage: bool) -> tuple[str, torch.Tensor, object]:
    """A torch.save file of one float32 tensor of SHAPE, its bytes, and where merger's reader locates rows 1-4."""
    w = torch.randn(SHAPE)
    path = tmp_path / "state.pt"
    torch.save({"w": w}, path)
    if damage:  # one bit of row 2, inside the record's data: only its CRC-32 can tell
        data = bytearray(path.read_bytes())
        at = data.find(w[2].numpy().tobytes())
        data[at + 5] ^= 0x10
        path.write_bytes(bytes(data))
    states = MappedStates(lambda f: torch_load(f, "test file"))
    return str(path), w, states.stored(str(path), states[str(path)]["w"][1:5])


def test_a_copied_piece_is_checked_against_its_record(tmp_path):
    _, w, stored = _saved(tmp_path, damage=False)
    plan = _OneTensor()
    out = plan.create(tmp_path)
    sink, reads = FileSink(tmp_path, plan), SourceReads()
    place = lambda fd, at, name: sink.copy_part(SPEC, block_runs(SHAPE, _piece((1, 0), (4, 1024))), fd, at, name)  # noqa: E731
    assert reads.copy_unchanged(stored, "w", place)
    reads.finish()  # rows 0 and 5, which no piece copied, are read for the record's check alone
    assert all(check is None for check in reads.checks.values())
    reads.close()
    sink.close()
    merged = torch.frombuffer(bytearray(out.read_bytes()[len(HEADER):]), dtype=torch.float32).view(SHAPE)
    assert torch.equal(merged[1:5], w[1:5]) and not merged[0].any() and not merged[5].any()


def test_a_damaged_copied_piece_fails_its_checksum(tmp_path):
    file, _, stored = _saved(tmp_path, damage=True)
    plan = _OneTensor()
    plan.create(tmp_path)
    sink, reads = FileSink(tmp_path, plan), SourceReads()
    place = lambda fd, at, name: sink.copy_part(SPEC, block_runs(SHAPE, _piece((1, 0), (4, 1024))), fd, at, name)  # noqa: E731
    assert reads.copy_unchanged(stored, "w", place)
    with pytest.raises(MergerError, match=f"checksum mismatch in tensor w: .*, {file}$"):
        reads.finish()
    reads.close()
    sink.close()
