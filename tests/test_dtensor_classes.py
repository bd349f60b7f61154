"""merger's stand-ins for torch.distributed.tensor's classes (merger/sources/dtensor_classes.py) against torch's own.

Rank files written by torch's fully_shard (a 1-D mesh with uneven shards and a replicated buffer, HSDP's 2-D mesh)
and by torch's DTensor classes directly (layouts fully_shard does not make: tests/writers/dtensor_rank_files.py)
are loaded in a fresh process through merger's loader, which must import neither torch.distributed.tensor nor
sympy, and every entry is described: class, global shape and dtype, placements, mesh and its dim names, shard
order, and the bytes of the local shard. The oracle is the same file loaded here with torch's own classes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from merger.sources import dtensor_classes
from merger.sources.fsdp import load_rank_file, open_catalog
from tests.helpers.dtensor_description import describe, describe_catalog
from tests.helpers.in_process import single_error_line
from tests.helpers.processes import run, run_merger, run_writer

pytestmark = [pytest.mark.slow, pytest.mark.interpreter]


# In a fresh process: merger's loader over each file, the modules it left imported, and the catalog.
_FRESH = """
import json, sys
from pathlib import Path
from merger.sources import dtensor_classes
from merger.sources.fsdp import load_rank_file, open_catalog
from tests.helpers.dtensor_description import describe, describe_catalog
if sys.argv[2]:
    dtensor_classes.COVERED = dtensor_classes.COVERED - {sys.argv[2]}
files = sorted(Path(sys.argv[1]).glob("model_world_size_*_rank_*.pt"))
states = [load_rank_file(str(f)) for f in files]
catalog = open_catalog(Path(sys.argv[1]))
print(json.dumps({
    "files": [describe(s) for s in states],
    "imported": sorted(m for m in ("torch.distributed.tensor", "sympy") if m in sys.modules),
    "catalog": describe_catalog(catalog),
}))
"""


def fresh_load(actor: Path, uncover: str = "") -> dict:
    out = run([sys.executable, "-c", _FRESH, str(actor), uncover])
    return json.loads(out.stdout)


def torch_described(actor: Path) -> list[dict]:
    """The oracle: each rank file loaded with torch's own classes (imported in this process)."""
    files = sorted(actor.glob("model_world_size_*_rank_*.pt"))
    return [describe(torch.load(f, map_location="cpu", weights_only=True, mmap=True)) for f in files]


def catalog_here(actor: Path) -> dict:
    return describe_catalog(open_catalog(actor))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """dtensor_rank_files.py's checkpoints, by case: (actor folder, whole tensor)."""
    made = {}

    def make(case: str) -> tuple[Path, torch.Tensor]:
        if case not in made:
            actor = tmp_path_factory.mktemp(case) / "actor"
            run_writer("dtensor_rank_files.py", "--out", actor, "--case", case)
            made[case] = actor, torch.load(actor.parent / "reference.pt", weights_only=True)["w"]
        return made[case]

    return make


CHECKPOINTS = {
    "1-D mesh, uneven shards, a replicated buffer": dict(arch="llama", world=4, extra=("--buffer",)),
    "HSDP 2 x 2": dict(arch="qwen2", world=4, mesh="2,2"),
}


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_rank_files_read_as_torch_reads_them(fsdp_checkpoint, case):
    actor, _ = fsdp_checkpoint(**CHECKPOINTS[case])
    fresh = fresh_load(actor)
    assert fresh["imported"] == []  # the point of the stand-ins: DTensor's package and sympy stay out
    ours = fresh["files"]
    assert len(ours) == 4 and ours == torch_described(actor)
    assert {e["class"] for f in ours for e in f.values()} >= {"DTensor"}
    if case == "HSDP 2 x 2":
        assert ours[0]["model.embed_tokens.weight"]["shown"] == ["R", "S(0)"]
        assert ours[0]["model.embed_tokens.weight"]["mesh_dim_names"] == ["ddp", "fsdp"]
    # The catalog from the stand-ins is the one from torch's classes (this process has them imported).
    assert fresh["catalog"] == catalog_here(actor)


def test_older_torch_spec_reads_as_torch_reads_it(written):
    """A spec pickled without shard_order (torch before it) reads as the default order, as torch's class says."""
    actor, _ = written("older-torch")
    fresh = fresh_load(actor)
    assert fresh["imported"] == []
    assert fresh["files"] == torch_described(actor)
    assert fresh["files"][0]["w"]["shard_order"] is None and fresh["files"][0]["w"]["shown"] == ["S(0)", "S(0)"]
    assert fresh["catalog"] == catalog_here(actor)


def test_older_torch_spec_merges_to_the_whole_tensor(written, tmp_path):
    actor, whole = written("older-torch")
    config = tmp_path / "config"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    run_merger("merge", "--local_dir", actor, "--hf_model_config_path", config, "--target_dir", tmp_path / "out",
               "--dtype", "keep", nproc=2)
    from safetensors.torch import load_file
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["w"], whole)


def test_split_order_other_than_mesh_order_is_refused(written, tmp_path):
    """Shard(0) over both mesh dims, mesh dim 1 first: the blocks are not those of mesh-dim order. Refused, not
    scrambled, from the stand-ins' spec and from torch's."""
    actor, _ = written("reversed-order")
    assert torch_described(actor)[0]["w"]["shard_order"] == [[0, [1, 0]]]
    out = run_merger("merge", "--local_dir", actor, "--target_dir", tmp_path / "out", check=False)
    assert out.returncode != 0
    want = (f"merger: error: tensor w is split in the order dim 0 over mesh dims (1, 0), not in mesh-dim order, "
            f"which merger cannot merge, {actor / 'model_world_size_4_rank_0.pt'}")
    assert single_error_line(out.stderr) == want
    with pytest.raises(Exception, match="not in mesh-dim order"):
        open_catalog(actor)  # this process: torch's own classes


def test_a_class_the_stand_ins_do_not_cover_loads_with_torchs(fsdp_checkpoint):
    """A file naming a torch.distributed class outside the stand-ins (as a later torch may pickle one) is read with
    torch's own classes: taken here as ShardOrderEntry, struck from what the stand-ins cover."""
    actor, _ = fsdp_checkpoint(**CHECKPOINTS["HSDP 2 x 2"])
    fresh = fresh_load(actor, uncover="torch.distributed.tensor._dtensor_spec.ShardOrderEntry")
    assert fresh["imported"] == ["sympy", "torch.distributed.tensor"]
    assert fresh["files"] == torch_described(actor)
    assert fresh["catalog"] == catalog_here(actor)


def test_torch_classes_are_used_once_imported(fsdp_checkpoint):
    """Where torch's own classes are imported (this process), both would claim the same names: torch's are used."""
    actor, _ = fsdp_checkpoint(**CHECKPOINTS["HSDP 2 x 2"])
    state = load_rank_file(str(actor / "model_world_size_4_rank_0.pt"))
    assert isinstance(state["model.embed_tokens.weight"], DTensor)
    assert dtensor_classes.dtensor_types() == (dtensor_classes.DTensor, DTensor)


def test_stand_in_refuses_to_compute():
    """A stand-in DTensor describes a saved tensor; an operation on it is an error, not a wrong result."""
    spec = dtensor_classes.DTensorSpec()
    spec.__dict__.update(placements=(), mesh=None)
    value = torch.Tensor._make_wrapper_subclass(dtensor_classes.DTensor, (2, 3), dtype=torch.float32)
    value.__setstate__((None, {"_local_tensor": torch.zeros(2, 3), "_spec": spec}))
    assert value.shape == (2, 3) and value._local_tensor.shape == (2, 3)
    with pytest.raises(RuntimeError, match="stand-in only describes a saved tensor; it cannot run aten.add"):
        value + 1
