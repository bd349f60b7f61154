"""Multi-token-prediction layers, whichever naming holds them (naming.py): which to write, the shared tensors
each holds again, and the config.json count of them. A family HF has no MTP layers for refuses them unless
--drop-mtp leaves them out, so a checkpoint's layers are never left out unasked."""
from __future__ import annotations

from ..catalog import Catalog
from ..errors import MergerError
from ..options import MergeOptions
from . import kinds
from .family import Family
from .naming import Naming
from .steps import Step


def _number(name: str, prefix: str) -> str:
    return name[len(prefix):].split(".", 1)[0]


def mtp_layers(catalog: Catalog, naming: Naming, family: Family, config: dict, options: MergeOptions) -> list[int]:
    """The MTP layer numbers to write: none with --drop-mtp; an error for a family HF has no MTP layers for, or
    when config.json's layer count would misnumber them."""
    names = [n for n in catalog.tensors if n.startswith(naming.mtp.prefix)]
    if not names or options.drop_mtp:
        return []
    if family.mtp_count_key is None:
        raise MergerError(f"{naming.name} tensor {names[0]} belongs to a multi-token-prediction layer, which the "
                          f"{family.name} family has no HF names for (pass --drop-mtp to leave MTP layers out), "
                          f"{catalog.root}")
    decoder = {_number(n, naming.decoder) for n in catalog.tensors if n.startswith(naming.decoder)}
    if len(decoder) != config.get("num_hidden_layers"):
        raise MergerError(f"the checkpoint has {len(decoder)} decoder layers but config.json's num_hidden_layers is "
                          f"{config.get('num_hidden_layers')}, so its MTP layers would be misnumbered, {catalog.root}")
    return sorted({int(_number(n, naming.mtp.prefix)) for n in names})


def shared_steps(catalog: Catalog, naming: Naming, config: dict, layers: list[int]) -> list[Step]:
    """The embedding and output layer again, as each MTP layer's own (DeepSeek-V3's checkpoints hold them)."""
    steps = []
    for j in layers:
        for row in naming.mtp.shared:
            tensor = catalog.tensors.get(row.source) or catalog.tensors.get(naming.mtp.tied_source)
            if tensor is not None:
                targets = tuple(f"model.layers.{config['num_hidden_layers'] + j}.{t}" for t in row.targets)
                steps.append(kinds.step(tensor.name, tensor.shape, tensor.dtype, row.kind, targets, config))
    return steps


def count_update(family: Family, layers: list[int]) -> dict:
    """config.json's count of MTP layers, set to those written (0 with --drop-mtp)."""
    return {family.mtp_count_key: len(layers)} if family.mtp_count_key else {}
