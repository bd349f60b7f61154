"""The plan of a gpt-oss merge, read for what its writers hold: HF keeps the experts stacked [E, ...] in one tensor,
and no step may make more of one than an expert's slab."""
from __future__ import annotations

import json
from pathlib import Path

from merger.api.pipeline import prepare
from merger.engine.dist import Group
from merger.options import MergeOptions


def assert_stacks_written_by_expert(local_dir: Path, hf_dir: Path, merge_ranks: int = 2) -> None:
    """Planned for MERGE_RANKS ranks: each of the 4 stacked expert tensors of every layer (gate_up_proj, down_proj
    and their biases) is one entry of the files, and every step writing one either is placed where its pieces are
    read (a cast, writer None: nothing assembled) or makes one expert's slab, 1/E of its bytes, from one input; the
    slabs are written by more than one rank."""
    config = json.loads((hf_dir / "config.json").read_text())
    plan = prepare(MergeOptions(local_dir=local_dir, hf_model_config_path=hf_dir, dtype="float32"), Group(),
                   merge_ranks).plan
    stacks = {n: e.end - e.begin for n, (_, e) in plan.location.items() if ".mlp.experts." in n}
    assert len(stacks) == 4 * config["num_hidden_layers"], sorted(stacks)
    writing, writers = {}, set()
    for step, writer in zip(plan.steps, plan.writers):
        for spec in (o for o in step.outputs if o.name in stacks):
            assert writer is None or (len(step.inputs) == 1
                                      and spec.nbytes * config["num_local_experts"] == stacks[spec.name]), spec
            writing[spec.name] = writing.get(spec.name, 0) + spec.nbytes
            writers.add(writer)
    assert writing == stacks  # every stack written whole, by its slabs
    assert len(writers - {None}) == merge_ranks
