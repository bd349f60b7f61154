"""The modules transformers keeps in float32 when it loads a model at a lower dtype, read from its modeling sources.

A model class may name modules to keep in float32: `_keep_in_fp32_modules_strict` at float16 and bfloat16,
`_keep_in_fp32_modules` at float16 only (modeling_utils' _get_dtype_plan). The lists a loaded model goes by are its
class's joined, in post_init, with those of each module it holds directly as `self.<name>`, which for a model held
inside (a causal LM's base model, a VLM's text and vision models) are that model's own, joined the same way. A
class's attributes alone miss those: HY-V4's causal LM names only `lm_head`, its base model the rest.

Reading them by importing the model's module cost a rank 1.5-3.7 s and ~170 MB on this project's 2-core machine
(DeepSeek-V3: 3.7 s, transformers and 2,068 modules), for two lists of names. So they are read from the sources, as
Python's parser sees them, without importing transformers: the classes of the model's modeling module and of the
modules it imports classes from; a list as the first class in the bases (depth first: transformers' models inherit
singly, with mixins that have no lists) that assigns it; the modules held, as `__init__` (or the one a class
inherits, and its `super().__init__`) assigns `self.<name> = Class(...)` or `Class._from_config(...)`. A model held
through `AutoModel.from_config(config.<sub>)` (a VLM's) is the class transformers' auto mapping names for the
sub-config's model type: only then is transformers imported, to name it and find its source (such composite models
import it anyway: saved_names.py), and where a model type's folder is not its name (`kosmos-2.5`).
Most families name no list: the sources are first searched as text, and parsed only where they name one.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("merger")

STRICT, LOOSE = "_keep_in_fp32_modules_strict", "_keep_in_fp32_modules"
# A modeling module's imports of another modeling module (`..x.modeling_x`, or `.modeling_y` beside it), whose
# classes it may subclass or hold.
_MODELING_IMPORT = re.compile(r"^from \.(?:\.(\w+)\.)?(modeling_\w+) import", re.MULTILINE)
_FROM_CONFIG = ("_from_config", "from_config")
_ROOT = "PreTrainedModel"  # transformers' base of every model: its lists are None


def _models_folder() -> Path | None:
    spec = importlib.util.find_spec("transformers")  # a top-level name: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def _model_types(config: dict) -> list[str]:
    return [c["model_type"] for c in (config, *config.values())
            if isinstance(c, dict) and isinstance(c.get("model_type"), str)]


def _module_file(models: Path, model_type: str) -> Path:
    name = model_type.replace("-", "_")
    return models / name / f"modeling_{name}.py"


@dataclass
class _Module:
    """One parsed modeling module: its classes, and the names it imports from other modeling modules."""
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    imported: dict[str, tuple[Path, str]] = field(default_factory=dict)  # local name -> (module file, its name)


class _Sources:
    """Classes as the modeling sources define them, each module parsed once; a class is found as (its module
    file, its definition), and a model held as that and the config (or sub-config) it is made with."""

    def __init__(self):
        self.texts: dict[Path, str | None] = {}
        self.modules: dict[Path, _Module | None] = {}
        self.lists: dict[tuple, frozenset[str]] = {}

    def text(self, path: Path) -> str | None:
        """The module's source, read once; None where there is none."""
        if path not in self.texts:
            try:
                self.texts[path] = path.read_text()
            except OSError:
                self.texts[path] = None
        return self.texts[path]

    def name_them(self, models: Path, config: dict) -> bool:
        """Whether the modeling sources of the config's model types (and those they import classes from) name the
        lists; True too where a source cannot be found, so that it is looked for by class."""
        todo = [_module_file(models, t) for t in _model_types(config)]
        seen = set()
        while todo:
            path = todo.pop()
            if path in seen:
                continue
            seen.add(path)
            text = self.text(path)
            if text is None or LOOSE in text:  # STRICT contains LOOSE
                return True
            todo += [(models / folder if folder else path.parent) / f"{module}.py"
                     for folder, module in _MODELING_IMPORT.findall(text)]
        return False

    def module(self, path: Path) -> _Module | None:
        if path not in self.modules:
            text = self.text(path)
            try:
                tree = ast.parse(text, str(path)) if text is not None else None
            except (SyntaxError, ValueError):
                tree = None
            if tree is None:
                self.modules[path] = None
                return None
            module = self.modules[path] = _Module()
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    module.classes[node.name] = node
                elif isinstance(node, ast.ImportFrom) and node.module and node.level in (1, 2):
                    # `.modeling_x` (this folder) or `..x.modeling_x` (another model's)
                    source = (path.parent if node.level == 1 else path.parent.parent).joinpath(
                        *node.module.split(".")).with_suffix(".py")
                    for alias in node.names:
                        module.imported[alias.asname or alias.name] = (source, alias.name)
        return self.modules[path]

    def find(self, path: Path, name: str) -> tuple[Path, ast.ClassDef] | None:
        """The class `name` as module `path` sees it: its own, or one it imports, followed to its source."""
        for _ in range(8):  # re-exports chain a few modules at most
            module = self.module(path)
            if module is None:
                return None
            if name in module.classes:
                return path, module.classes[name]
            if name not in module.imported:
                return None
            path, name = module.imported[name]
        return None

    def bases(self, path: Path, cls: ast.ClassDef) -> list[tuple[Path, ast.ClassDef] | str]:
        """The class's bases: found ones as (module, class), the others (transformers' own) by name."""
        found = []
        for base in cls.bases:
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if name is not None:
                found.append(self.find(path, name) or name)
        return found

    def is_model(self, path: Path, cls: ast.ClassDef, depth: int = 0) -> bool:
        return depth < _DEPTH and any(b == _ROOT if isinstance(b, str) else self.is_model(*b, depth=depth + 1)
                                      for b in self.bases(path, cls))

    def attribute(self, path: Path, cls: ast.ClassDef, name: str, depth: int = 0) -> frozenset[str] | None:
        """The list `name` as the class has it: assigned in its body, else by its first base that assigns it;
        None where none does."""
        for node in cls.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) and node.value is not None else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                try:
                    return frozenset(ast.literal_eval(node.value) or ())
                except ValueError:
                    log.warning("merger: %s.%s is not a literal list in %s; read as empty (its modules are written "
                                "in the output dtype)", cls.name, name, path)
                    return frozenset()
        for base in self.bases(path, cls):
            if not isinstance(base, str) and depth < _DEPTH:
                if (found := self.attribute(*base, name, depth + 1)) is not None:
                    return found
        return None

    def held(self, path: Path, cls: ast.ClassDef, config: dict, depth: int = 0) -> list[tuple]:
        """The classes `__init__` assigns to `self.<name>`, with those of the `__init__` it inherits or calls
        through super(), each with the config it is made with."""
        init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        parents = [b for b in self.bases(path, cls) if not isinstance(b, str)]
        if init is None:
            return self.held(*parents[0], config, depth + 1) if parents and depth < _DEPTH else []
        held = []
        for node in ast.walk(init):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and any(
                    isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                    for t in node.targets):
                held += self._made(path, node.value, config)
        if parents and depth < _DEPTH and any(_calls_super_init(n) for n in ast.walk(init)):
            held += self.held(*parents[0], config, depth + 1)
        return held

    def _made(self, path: Path, call: ast.Call, config: dict) -> list[tuple]:
        """The class a call makes, with its config: `Class(config...)`, `Class._from_config(config...)`,
        `AutoModel.from_config(config.<sub>)`."""
        arg = call.args[0] if call.args else None
        if isinstance(arg, ast.Attribute) and isinstance(config.get(arg.attr), dict):
            config = config[arg.attr]  # `config.text_config`: the model is made with the sub-config
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in _FROM_CONFIG and isinstance(func.value, ast.Name):
            if func.value.id.startswith("AutoModel"):
                found = _transformers_class(self, _auto_model_name(config.get("model_type")))
                return [(*found, config)] if found is not None else []
            func = func.value
        if isinstance(func, ast.Name) and (found := self.find(path, func.id)) is not None:
            return [(*found, config)]
        return []

    def model_list(self, path: Path, cls: ast.ClassDef, config: dict, name: str, depth: int = 0) -> frozenset[str]:
        """A model's list `name` as post_init leaves it: its class's, joined with each held module's (a held
        model's as post_init leaves it)."""
        key = (path, cls.name, id(config), name)
        if key not in self.lists:
            self.lists[key] = frozenset()  # a model that holds itself adds nothing
            names = set(self.attribute(path, cls, name) or ())
            for held_path, held, held_config in self.held(path, cls, config) if depth < _DEPTH else []:
                names |= self.model_list(held_path, held, held_config, name, depth + 1) \
                    if self.is_model(held_path, held) else self.attribute(held_path, held, name) or set()
            self.lists[key] = frozenset(names)
        return self.lists[key]


_DEPTH = 32  # how deep bases and held models are followed: far beyond any model's


def _calls_super_init(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__init__" \
        and isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Name) \
        and node.func.value.func.id == "super"


def _transformers_class(sources: _Sources, name: str | None) -> tuple[Path, ast.ClassDef] | None:
    """transformers' class `name`, found in its source through transformers itself: for a model type whose folder
    is not its name (`kosmos-2.5`, `nemo_speechlm`), and for a model transformers' auto classes make. Imports
    transformers."""
    try:
        import transformers

        cls = getattr(transformers, name or "", None)
        path = Path(inspect.getsourcefile(cls)) if isinstance(cls, type) else None
    except Exception as e:  # noqa: BLE001 - transformers failing to import its module: nothing to read there
        log.debug("merger: no keep-in-fp32 modules of %s (%s)", name, e)
        return None
    return sources.find(path, cls.__name__) if path is not None else None


def _auto_model_name(model_type: str | None) -> str | None:
    """The class `AutoModel.from_config` makes for a config of `model_type` (transformers' auto mapping)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    except Exception as e:  # noqa: BLE001 - as above
        log.debug("merger: no auto model class for %s (%s)", model_type, e)
        return None
    return MODEL_MAPPING_NAMES.get(model_type)


def keep_in_fp32(config: dict, dtype: torch.dtype | None) -> tuple[str, ...]:
    """The module patterns transformers keeps in float32 when the model is loaded, and so saved, at `dtype`. Each
    pattern is a regular expression searched in a tensor's name. Remote code (`auto_map`) has none here."""
    models, sources = _models_folder(), _Sources()
    if dtype not in (torch.float16, torch.bfloat16) or "auto_map" in config or models is None \
            or not sources.name_them(models, config):
        return ()
    lists = (STRICT, LOOSE) if dtype == torch.float16 else (STRICT,)
    names = set()
    for arch in config.get("architectures") or []:
        found = next((c for t in _model_types(config) if (c := sources.find(_module_file(models, t), arch))),
                     None) or _transformers_class(sources, arch)
        if found is None:
            log.debug("merger: no source of %s in transformers: no keep-in-fp32 modules", arch)
            continue
        for name in lists:
            names |= sources.model_list(*found, config, name)
    return tuple(sorted(names))
