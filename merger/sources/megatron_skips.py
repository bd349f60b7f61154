"""The entries of a Megatron checkpoint that are not model weights, each left out by a named rule.

Every other entry is a weight that the model family's table must name (mapping/megatron.py refuses one it
cannot), so a layer is never dropped without a word. The catalog records what each rule left out
(`Catalog.skipped`: name -> rule) and `merger inspect` lists it.
"""
from __future__ import annotations

# (rule, why), checked in order against a stored name (torch_dist: the DCP key; legacy: the model dict's key).
RULES = (
    ("extra_state", "module extra state (Transformer Engine FP8 scaling metadata, None for local layers), "
                    "not a weight", lambda n: n.endswith("_extra_state") or "._extra_state/" in n),
    ("optimizer", "optimizer state", lambda n: n.startswith(("optimizer.", "optim."))),
    ("rng_state", "random generator states", lambda n: n.startswith("rng_state")),
    ("rotary_inv_freq", "rotary frequencies, which transformers recomputes from config.json",
     lambda n: n.endswith("rotary_pos_emb.inv_freq")),
)
NOT_A_TENSOR = "not_a_tensor"  # a pickled object (a ShardedObject, None, a byte stream): no weight is one
WHY = {rule: why for rule, why, _ in RULES} | {NOT_A_TENSOR: "a stored object that is not a tensor"}


def skip_rule(name: str) -> str | None:
    """The rule that leaves `name` out, or None for a weight."""
    return next((rule for rule, _, matches in RULES if matches(name)), None)
