"""Everything a merge is told, as one frozen dataclass shared by the CLI, the API, the launcher and the tests.

Frozen: the options are checked once, where they are made (flags.py: from the command line, or from the API's
keywords), and a step that needs other values (`merger watch`'s per-step target, `test`'s dtype) makes its own copy
with dataclasses.replace, so no code sees options change under it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The output dtypes, by torch's names: --dtype's choices. Names rather than torch.dtypes, so that the command line
# parses (and --help, a usage error, --version answer) without importing torch; MergeOptions.torch_dtype looks
# the dtype up when a merge needs it.
DTYPES = ("bfloat16", "float16", "float32", "keep")
# The spellings HF (`torch_dtype="half"`), verl and mixed-precision configs (`bf16`) use for the same dtypes.
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def dtype_name(spelling: str) -> str:
    """The canonical name (a key of DTYPES) for a dtype as users spell it; unknown spellings are returned as they
    are, for the caller to refuse."""
    lowered = spelling.lower().removeprefix("torch.")
    return DTYPE_ALIASES.get(lowered, lowered)


def _shapes_output(default):
    """An option that changes the bytes a merge writes: `--resume` reuses files only when these are unchanged.

    Options left unmarked change how a merge runs (ranks, memory, logging, checks, publishing), never its output;
    which checkpoint is read is compared by identity (resolved folder, each file's inode, size, mtime, ctime).
    """
    return field(default=default, metadata={"shapes_output": True})


@dataclass(frozen=True)
class MergeOptions:
    local_dir: Path
    target_dir: Path | str | None = None  # a str only for an object URL (s3://bucket/prefix)
    stage_dir: Path | None = None  # an object-store target is written here first, then uploaded
    backend: str = "auto"  # the detected format is what a resume compares, so an explicit spelling changes nothing
    hf_model_config_path: str | Path | None = _shapes_output(None)  # a folder, or a Hub model id (hub_folders.py)
    prefix: str | None = _shapes_output(None)  # DCP: the nesting prefix to take off names (None: detect)
    model: str = _shapes_output("auto")  # source naming: auto (detect from names), hf, torchtitan-llama
    dtype: str = _shapes_output("bfloat16")
    max_shard_size: int = _shapes_output(5_000_000_000)
    max_inflight: int = 512 << 20
    device: str = "auto"
    overwrite: bool = False
    tie_word_embedding: bool = _shapes_output(False)
    trust_remote_code: bool = False
    dist_timeout: float = 600.0
    debug: bool = False
    keep_partial: bool = False  # keep the staging folder when a merge fails
    resume: bool = False  # reuse the finished files of an interrupted merge (implies keep_partial)
    is_value_model: bool = _shapes_output(False)  # a critic: token-classification head (`score.weight`)
    drop_mtp: bool = _shapes_output(False)  # Megatron: leave multi-token-prediction layers out
    verify: bool = False  # re-read the written output and compare it with the source before the rename
    hf_upload_path: str | None = None  # "user/name": publish the finished folder to the Hugging Face Hub
    private: bool = False
    summary_json: Path | None = None
    allow_overflow: bool = _shapes_output(False)  # let values beyond float16's range become inf
    lora: str = _shapes_output("fuse")  # PEFT-wrapped checkpoints: fold the adapter in, or write it apart
    lora_r: int | None = _shapes_output(None)
    lora_alpha: float | None = _shapes_output(None)
    base_model: str | Path | None = _shapes_output(None)  # adapter-only checkpoints: HF folder or Hub id to fold into
    adapter_config: Path | None = _shapes_output(None)  # LoRA checkpoints: the adapter's adapter_config.json
    adapters: tuple[Path, ...] = _shapes_output(())  # `merger lora`: PEFT adapter folders folded into the base
    quantize_like: str | Path | None = _shapes_output(None)  # an FP8 or gpt-oss MXFP4 release (folder or Hub id)
    # fp8-block: FP8 in 128x128 blocks, transformers' choice of modules; mxfp8: the same in 1x32 blocks, e8m0 scales
    # (transformers' mxfp8); mxfp4: gpt-oss's experts in MXFP4; nvfp4, int4: compressed-tensors' (Linear layers;
    # routed experts)
    quantize: str | None = _shapes_output(None)
    family: Path | None = _shapes_output(None)  # Megatron: a family file (TOML or JSON) to map the checkpoint by

    @property
    def torch_dtype(self) -> torch.dtype | None:
        import torch  # only a merge asks, and it has imported torch already; see DTYPES

        return None if self.dtype == "keep" else getattr(torch, self.dtype)

    def output_shaping(self) -> dict:
        """The options marked as changing the output's bytes, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("shapes_output")}
