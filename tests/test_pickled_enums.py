"""Enum members pickled by name (`getattr(EnumClass, "NAME")`, as Python 3.11.0-3.11.4 write them) load; no
other getattr does.

Checkpoints come from the libraries themselves (torch.distributed.checkpoint, torch.save) and are given the
by-name form with tests/helpers/enums_by_name.py; on an interpreter that writes that form itself, dcp.save's own file
is checked to hold it. Oracles: torch's own readers of the original files. The hostile pickles are chains of
getattr calls through allowlisted classes that plain pickle.loads does run (checked with a marker folder);
ours must refuse them with the marker never made.
"""
from __future__ import annotations

import argparse
import io
import pickle
import struct
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from merger.errors import MergerError
from merger.sources.dcp_chunk_table import load_chunk_table
from merger.sources.dcp_metadata import load_metadata
from merger.sources.megatron_legacy import load_file
from merger.sources.safe_load import torch_load
from tests.helpers.dcp_fields import plain
from tests.helpers.enums_by_name import PICKLE_MODULE, repickle

pytestmark = pytest.mark.interpreter

METADATA = "torch.distributed.checkpoint.metadata"
ENUM = (METADATA, "_MEM_FORMAT_ENCODING")  # an enum DCP pickles in every tensor's properties
WRITES_BY_NAME = (3, 11, 0) <= sys.version_info[:3] <= (3, 11, 4)


# Pickles written opcode by opcode (protocol 2, as torch.save), so each call is exactly the one named.
def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def _str(s: str) -> bytes:
    return b"X" + struct.pack("<I", len(s.encode())) + s.encode()


def _call(func: bytes, *args: bytes) -> bytes:
    return func + b"(" + b"".join(args) + b"tR"  # MARK args... TUPLE REDUCE


def _getattr(obj: bytes, name: str, module: str = "builtins") -> bytes:
    return _call(_global(module, "getattr"), obj, _str(name))


def _pickle(body: bytes) -> bytes:
    return b"\x80\x02" + body + b"."


def _eval_through(cls: bytes, marker: Path) -> bytes:
    """getattr(cls, "__init__").__globals__["__builtins__"]["eval"]("os.mkdir(marker)")."""
    module_globals = _getattr(_getattr(cls, "__init__"), "__globals__")
    builtins = _call(_getattr(module_globals, "get"), _str("__builtins__"))
    evaluate = _call(_getattr(builtins, "get"), _str("eval"))
    return _pickle(_call(evaluate, _str(f"__import__('os').mkdir({str(marker)!r})")))


HOSTILE_CALLS = {
    "allowed class, not an enum": _getattr(_global(METADATA, "Metadata"), "__init__"),
    "dunder of an allowed enum": _getattr(_global(*ENUM), "__init__"),
    "class of an allowed enum": _getattr(_global(*ENUM), "__class__"),
    "member map of an allowed enum": _getattr(_global(*ENUM), "_member_map_"),
    "attribute of a member": _getattr(_getattr(_global(*ENUM), "TORCH_CONTIGUOUS"), "__class__"),
    "with a default": _call(_global("builtins", "getattr"), _global(*ENUM), _str("NOPE"), b"N"),
    "name not a string": _call(_global("builtins", "getattr"), _global(*ENUM), b"K\x01"),
    "method of a plain type": _getattr(_global("collections", "OrderedDict"), "fromkeys"),
    "protocol 2 spelling": _getattr(_global(METADATA, "Metadata"), "__init__", module="__builtin__"),
}


@pytest.fixture
def dcp_folder(tmp_path) -> Path:
    folder = tmp_path / "dcp"
    dcp.save({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)},
             checkpoint_id=folder, no_dist=True)
    return folder


def test_dcp_metadata_with_enums_by_name_loads_as_torch_reads_it(dcp_folder):
    original = FileSystemReader(dcp_folder).read_metadata()  # torch's own reader (plain pickle.load)
    if WRITES_BY_NAME:  # this interpreter wrote the by-name form itself: the real thing, not a rewrite
        assert b"getattr" in (dcp_folder / ".metadata").read_bytes()
    repickle(dcp_folder / ".metadata")
    ours = load_metadata(dcp_folder)
    assert plain(ours.state_dict_metadata) == plain(original.state_dict_metadata)
    assert plain(ours.storage_data) == plain(original.storage_data)
    assert ours.state_dict_metadata["w"].properties.memory_format is torch.contiguous_format


def test_eval_chain_runs_under_plain_pickle(tmp_path):
    """The oracle for the hostile cases below: the chain is a working exploit when getattr is builtins'."""
    marker = tmp_path / "ran"
    pickle.loads(_eval_through(_global(METADATA, "Metadata"), marker))
    assert marker.is_dir()


@pytest.mark.parametrize("load", [load_metadata, load_chunk_table])
def test_eval_chain_through_dcp_classes_is_refused(dcp_folder, tmp_path, load):
    marker = tmp_path / "ran"
    (dcp_folder / ".metadata").write_bytes(_eval_through(_global(METADATA, "Metadata"), marker))
    with pytest.raises(MergerError, match=r"refusing to call getattr\(Metadata, '__init__'\).*\.metadata"):
        load(dcp_folder)
    assert not marker.exists()


@pytest.mark.parametrize("load", [load_metadata, load_chunk_table])
@pytest.mark.parametrize("case", list(HOSTILE_CALLS))
def test_any_other_getattr_in_dcp_metadata_is_refused(case, dcp_folder, load):
    (dcp_folder / ".metadata").write_bytes(_pickle(HOSTILE_CALLS[case]))
    with pytest.raises(MergerError, match=r"not a DCP metadata file \(refusing to call getattr"):
        load(dcp_folder)


def _megatron_args() -> argparse.Namespace:
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    # Megatron-LM keeps its parsed arguments, enums among them, in every legacy rank file.
    return argparse.Namespace(attention_backend=AttnBackend.auto, model_type=ModelType.encoder_or_decoder,
                              tensor_model_parallel_size=1)


def test_megatron_rank_file_with_enums_by_name_loads(tmp_path):
    path = tmp_path / "model_optim_rng.pt"
    state = {"model": {"decoder.final_layernorm.weight": torch.randn(8)}, "args": _megatron_args()}
    torch.save(state, path, pickle_module=PICKLE_MODULE)
    assert b"getattr" in zipfile.ZipFile(path).read("model_optim_rng/data.pkl")
    want = torch.load(path, weights_only=False)  # torch's own load of our trusted file
    got = load_file(str(path))
    assert vars(got["args"]) == vars(want["args"]) and got["args"].attention_backend is want["args"].attention_backend
    assert torch.equal(got["model"]["decoder.final_layernorm.weight"], want["model"]["decoder.final_layernorm.weight"])


def _with_data_pkl(path: Path, payload: bytes) -> None:
    """The torch.save file at `path` with its pickle replaced by `payload`, as a hostile file would ship it."""
    src = zipfile.ZipFile(io.BytesIO(path.read_bytes()))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, payload if info.filename.endswith("data.pkl") else src.read(info))


def test_eval_chain_through_torch_load_safe_globals_is_refused(tmp_path):
    marker = tmp_path / "ran"
    hostile = _eval_through(_global("argparse", "Namespace"), marker)
    pickle.loads(hostile)  # a working exploit under plain pickle...
    assert marker.is_dir()
    marker.rmdir()
    path = tmp_path / "rank.pt"
    torch.save({"w": torch.ones(2)}, path)
    _with_data_pkl(path, hostile)
    with pytest.raises(MergerError, match=r"refusing to load rank file: refusing to call getattr\(Namespace, "
                                          r"'__init__'\).*rank\.pt$"):
        torch_load(str(path), "rank file", safe_globals=(argparse.Namespace,))
    assert not marker.exists()  # ...that never ran here
