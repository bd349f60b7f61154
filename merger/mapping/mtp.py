"""Multi-token-prediction layers, whichever naming holds them (naming.py), written where the family's MtpLayout
(family.py) keeps them: which to write, the shared tensors each holds again, the config.json count of them, and the
line saying where they went. A family HF has no MTP layers for refuses them unless --drop-mtp leaves them out, so
a checkpoint's layers are never left out unasked."""
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


def mtp_layers(catalog: Catalog, naming: Naming, family: Family, config: dict, options: MergeOptions,
               prefix: str = "") -> list[int]:
    """The MTP layer numbers to write: none with --drop-mtp; an error for a family HF has no MTP layers for, for
    more layers than its layout holds, or when config.json's layer count would misnumber them. The model's names
    follow `prefix` (a Megatron VLM's text model's `language_model.`), and `config` is the text model's."""
    names = [n for n in catalog.tensors if n.startswith(prefix + naming.mtp.prefix)]
    if not names or options.drop_mtp:
        return []
    if family.mtp is None:
        raise MergerError(f"{naming.name} tensor {names[0]} belongs to a multi-token-prediction layer, which the "
                          f"{family.name} family has no HF names for (pass --drop-mtp to leave MTP layers out), "
                          f"{catalog.root}")
    layers = sorted({int(_number(n, prefix + naming.mtp.prefix)) for n in names})
    if family.mtp.own and len(layers) > 1:
        own = ", ".join(family.mtp.own.values())
        raise MergerError(f"the checkpoint has {len(layers)} multi-token-prediction layers, each with its own "
                          f"projection and norms, but HF's {family.name} holds one ({own}; pass --drop-mtp to leave "
                          f"MTP layers out), {catalog.root}")
    decoder = {_number(n, prefix + naming.decoder) for n in catalog.tensors if n.startswith(prefix + naming.decoder)}
    if not family.mtp.layer and len(decoder) != config.get("num_hidden_layers"):
        raise MergerError(f"the checkpoint has {len(decoder)} decoder layers but config.json's num_hidden_layers is "
                          f"{config.get('num_hidden_layers')}, so its MTP layers would be misnumbered, {catalog.root}")
    return layers


def shared_steps(catalog: Catalog, naming: Naming, family: Family, config: dict, layers: list[int]) -> list[Step]:
    """The embedding and output layer again, as each MTP layer's own, where HF holds them so (DeepSeek-V3's
    checkpoints do)."""
    steps = []
    for j in layers if family.mtp and family.mtp.shared else ():
        for row in naming.mtp.shared:
            tensor = catalog.tensors.get(row.source) or catalog.tensors.get(naming.mtp.tied_source)
            if tensor is not None:
                targets = tuple(f"model.layers.{config['num_hidden_layers'] + j}.{t}" for t in row.targets)
                steps.append(kinds.step(tensor.name, tensor.shape, tensor.dtype, row.kind, targets, config))
    return steps


def count_update(family: Family, layers: list[int]) -> dict:
    """config.json's count of MTP layers, set to those written (0 with --drop-mtp)."""
    return {family.mtp.count_key: len(layers)} if family.mtp else {}


def where(family: Family, layers: list[int], first: int) -> str:
    """Where the MTP layers are written, for the log: `model.layers.{first}-...` or `mtp.layers.0`."""
    if family.mtp.layer:
        return ", ".join(family.mtp.layer.format(j=j).rstrip(".") for j in layers)
    return f"model.layers.{first}{f'-{first + len(layers) - 1}' if len(layers) > 1 else ''}"
