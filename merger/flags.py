"""Every command's flags, in one parser: the command line parses with it, and the Python API checks its keyword
options through the same actions, so both accept the same values and refuse the rest with the same line.

verl spells flags with underscores (`--local_dir`); the dashed forms (`--local-dir`) work as well. A command line
that does not parse raises UsageError (exit code 2 in the CLI), never argparse's usage block and exit.

Neither this module nor what it imports imports torch: `merger --version`, `--help` and a command line that does not
parse answer in a fraction of a second, where importing torch takes about 2 s; a merge imports it after parsing.
It lies outside merger/api, whose package imports the engine (and torch) as soon as any of its modules is imported.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path
from typing import NoReturn

from .errors import MergerError, UsageError
from .io import location
from .io.locations import OBJECT_SCHEMES, ObjectPath
from .options import DTYPES, MergeOptions, dtype_name
from .sources import BACKENDS
from .units import parse_size, positive_int, positive_size
from .version import __version__

# --model's torchtitan values: mapping/torchtitan.py's MODELS, one per torchtitan family of mapping/families.py.
# Named here because the family records import torch, which the parser must not (`merger --help` and a usage error
# answer without it); tests/unit/test_family_records.py checks that the two lists agree.
TORCHTITAN_MODELS = ("torchtitan-llama", "torchtitan-qwen3", "torchtitan-deepseek-v3", "torchtitan-qwen3-5",
                     "torchtitan-gpt-oss")


class _Parser(argparse.ArgumentParser):
    """argparse, plus a hint for a misspelled flag: argparse reports the required flag the typo left out, or
    "unrecognized arguments", but never which known flag was meant."""

    _args: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._args = list(sys.argv[1:] if args is None else args)  # a subcommand's parser gets its own part
        return super().parse_known_args(args, namespace)

    def _command_parser(self) -> argparse.ArgumentParser | None:
        """The parser whose flags the arguments are: this one, or for the top level the chosen subcommand's
        (argparse reports a subcommand's unrecognized arguments from the top level)."""
        if self._subparsers is None:
            return self
        commands = next(a.choices for a in self._subparsers._group_actions if a.choices)
        return next((commands[arg] for arg in self._args if arg in commands), None)

    def error(self, message) -> NoReturn:
        """Raise UsageError with one line, not the usage block: the unknown flags with the known one each most likely meant (argparse's
        own complaint about them, "unrecognized arguments" or a required flag the typo left out, says less),
        else argparse's message; and where --help lists the rest."""
        parser = self._command_parser()
        known = [s for s in parser._option_string_actions if s.startswith("--")] if parser else []
        unknown = []
        for arg in self._args if parser else []:
            flag = arg.split("=", 1)[0]
            if flag.startswith("--") and not any(s.startswith(flag) for s in known):  # abbreviations are known
                close = difflib.get_close_matches(flag, known, n=1)
                unknown.append(f"unknown flag {flag}" + (f" (did you mean {close[0]}?)" if close else ""))
        about_flags = unknown or "arguments are required" in message or "unrecognized arguments" in message
        where = f" ({parser.prog if parser else self.prog} --help lists every flag)" if about_flags else ""
        raise UsageError(f"{'; '.join(unknown) or message}{where}")


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def local_path(text: str) -> Path:
    """A path argument: a local or mounted path, or file://. Any other URL is refused here, where a Path would
    have squeezed `s3://b/x` to the local folder `s3:/b/x`."""
    if (scheme := _SCHEME.match(text)) is None:
        return Path(text)
    if scheme.group(1).lower() == "file":
        return Path(text[len("file://"):])
    raise argparse.ArgumentTypeError(f"{scheme.group(1)}:// paths are not supported here: this flag takes a local "
                                     f"folder, or one of a mounted bucket (e.g. s3fs, gcsfuse, blobfuse2); "
                                     f"--local_dir, --hf_model_config_path, --base_model, --adapter, "
                                     f"--adapter_config and --quantize_like read buckets directly, and --target_dir "
                                     f"writes to a bucket too, {text}")


def target_path(text: str) -> Path | str:
    """Where a merge writes: a local or mounted folder, or a bucket's prefix (s3://, gs://, az://), kept as the URL
    given."""
    scheme = _SCHEME.match(text)
    if scheme is None or scheme.group(1).lower() == "file":
        return local_path(text)
    if scheme.group(1).lower() not in OBJECT_SCHEMES:
        hub = " (--hf_upload_path USER/NAME publishes the merged model to the Hub)" if \
            scheme.group(1).lower() in ("hf", "http", "https") else ""
        raise argparse.ArgumentTypeError(f"merged models are written to a local folder or a bucket (s3://, gs://, "
                                         f"az://), not to {scheme.group(1)}://{hub}, {text}")
    try:
        location(text)  # a URL naming no bucket is refused here
    except MergerError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text.rstrip("/")


def source_path(text: str) -> Path | ObjectPath:
    """A checkpoint's folder: local, mounted or file://, or a bucket's folder (s3://, gs://, az://; merger/io)."""
    try:
        return location(text)
    except MergerError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def folder_url_or_hub_id(text: str) -> str:
    """A folder (a bucket's too) or a Hub model id, kept as given (folder_or_hub_id)."""
    if _SCHEME.match(text):
        source_path(text)  # an unknown scheme is refused here
        return text
    return folder_or_hub_id(text)


def folder_or_hub_id(text: str) -> str:
    """A folder, or a Hub model id (mapping/hub_folders.py decides which): kept as given, since a Path would turn
    the local `./Qwen/x` into what reads as the id `Qwen/x`; URLs are refused as for any path."""
    local_path(text)
    return text


def _add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(*_flag("--target_dir"), dest="target_dir", type=target_path, required=True,
                        help=TARGET_HELP)
    parser.add_argument(*_flag("--stage_dir"), dest="stage_dir", type=local_path, default=None, metavar="DIR",
                        help="with a bucket --target_dir (s3://, gs://, az://): the local folder the model is written to "
                             "before its parts are uploaded (default: a temporary folder, removed after; ranks on "
                             "several nodes need one they all share); kept after the upload, for --resume")


def _flag(*names: str) -> list[str]:
    """verl spells flags with underscores; accept both `--local_dir` and `--local-dir`."""
    out = []
    for name in names:
        out += [name, name.replace("_", "-")] if "_" in name else [name]
    return list(dict.fromkeys(out))


def _add_source_args(p: argparse.ArgumentParser, what: str = "the checkpoint folder (e.g. global_step_100/actor)"
                     ) -> None:
    p.add_argument(*_flag("--local_dir"), dest="local_dir", type=source_path, required=True, help=what)
    p.add_argument("--backend", default="auto", choices=["auto", *BACKENDS],
                   help="checkpoint format (default auto: detect it)")
    p.add_argument("--prefix", default=None,
                   help="DCP: prefix to take off tensor names and keep only those under it, e.g. 'model' "
                        "(default: 'model.' when accelerate nested the state dict; '' keeps names as saved)")
    p.add_argument("--model", choices=["auto", "hf", *TORCHTITAN_MODELS], default="auto",
                   help="naming of the source tensors (default: detect; torchtitan-<family> converts torchtitan's "
                        "names to HF's and needs --hf_model_config_path)")
    p.add_argument("--family", type=local_path, default=None, metavar="FILE",
                   help="Megatron: map the checkpoint by this family file (TOML or JSON: its model types and layer "
                        "rows, docs/families.md) instead of the built-in family of config.json's model_type")
    p.add_argument(*_flag("--hf_model_config_path"), dest="hf_model_config_path", type=folder_url_or_hub_id,
                   default=None, help="folder with config.json, tokenizer, processor, chat template, remote code, or "
                                      "a Hub model id (owner/name; default: huggingface/ in the checkpoint)")
    p.add_argument(*_flag("--tie_word_embedding"), dest="tie_word_embedding", action="store_true",
                   help="write lm_head once, tied to the input embedding, whatever config.json says")
    p.add_argument(*_flag("--trust_remote_code"), dest="trust_remote_code", action="store_true",
                   help="accepted for verl's command line: remote-code files are always copied; pass "
                        "trust_remote_code=True when loading the output")
    p.add_argument(*_flag("--is_value_model"), dest="is_value_model", action="store_true",
                   help="a critic: write a token-classification model (score.weight, one label)")
    p.add_argument(*_flag("--drop_mtp"), dest="drop_mtp", action="store_true",
                   help="Megatron: leave multi-token-prediction layers out (and num_nextn_predict_layers 0); "
                        "default: write them after the decoder layers, as DeepSeek-V3's checkpoints hold them")
    p.add_argument("--lora", choices=["fuse", "separate"], default="fuse",
                   help="PEFT-wrapped checkpoints: fold the adapter in (default) or write base weights unfused; "
                        "both also write lora_adapter/ in PEFT's format")
    p.add_argument(*_flag("--lora_r"), dest="lora_r", type=int, default=None,
                   help="LoRA rank, when the checkpoint has no lora_train_meta.json")
    p.add_argument(*_flag("--lora_alpha"), dest="lora_alpha", type=float, default=None,
                   help="LoRA alpha, when the checkpoint records none (no lora_train_meta.json; Megatron-Bridge "
                        "adapter shards without their HF export)")
    p.add_argument(*_flag("--base_model"), dest="base_model", type=folder_url_or_hub_id, default=None,
                   help="adapter-only checkpoints (accelerate adapter_only DCP, verl save_lora_only): HF "
                        "safetensors folder, or Hub model id, to fold the adapter into (default: write the adapter "
                        "as a PEFT adapter folder)")
    p.add_argument(*_flag("--adapter_config"), dest="adapter_config", type=source_path, default=None,
                   help="checkpoints with a LoRA adapter: its adapter_config.json, file or folder (r, lora_alpha, "
                        "use_rslora, rank/alpha patterns; default: checkpoint-N/ and its parent for accelerate, "
                        "lora_train_meta.json and the tensors for verl)")


# --dtype spellings of formats that are no dtype to cast to: each is written with its scales by a flag of its own
_QUANTIZED_DTYPES = {"fp8": "--quantize fp8-block", "float8": "--quantize fp8-block",
                     "float8_e4m3fn": "--quantize fp8-block", "mxfp4": "--quantize mxfp4", "mxfp8": "--quantize mxfp8",
                     "nvfp4": "--quantize nvfp4", "int4": "--quantize int4"}


def _dtype(text: str) -> str:
    """--dtype's canonical name (argparse then checks it against the choices); a quantized format's name points to
    the flag that writes it."""
    name = dtype_name(text)
    if name in _QUANTIZED_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is a quantized format, not a dtype to cast to: "
                                         f"{_QUANTIZED_DTYPES[name]} writes it with its scales (or --quantize_like "
                                         f"RELEASE, in a release's layout)")
    return name


def _add_dtype_args(p: argparse.ArgumentParser, default: str, why: str) -> None:
    p.add_argument("--dtype", type=_dtype, choices=DTYPES, default=default,
                   help=f"output dtype of floating tensors (default {default}: {why}; also spelt bf16, fp16, half, "
                        f"fp32, float); keep = each tensor's own dtype")
    p.add_argument(*_flag("--allow_overflow"), dest="allow_overflow", action="store_true",
                   help="with --dtype float16: write inf for values beyond float16's range (default: fail, "
                        "naming the tensors)")


def _add_quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(*_flag("--quantize_like"), dest="quantize_like", type=folder_url_or_hub_id, default=None,
                   metavar="RELEASE", help="write the output in the layout of this release (folder or Hub model "
                                           "id): FP8 block-scaled (the tensors it quantizes as float8 with "
                                           "per-block weight_scale_inv) or gpt-oss MXFP4 (its experts as _blocks "
                                           "and _scales); the rest in its dtypes, its quantization_config")
    p.add_argument("--quantize", choices=["fp8-block", "mxfp8", "mxfp4", "nvfp4", "int4"], default=None,
                   help="fp8-block: FP8 block-scaled weights (128x128 blocks, float32 weight_scale_inv) for the "
                        "modules transformers' FP8 quantizer converts by default (Linear layers and experts; not "
                        "lm_head, nor one with a weight that is not whole 128x128 blocks); "
                        "mxfp8: the same modules as transformers' mxfp8 (1x32 blocks, e8m0 weight_scale_inv); "
                        "mxfp4: gpt-oss's MoE experts in MXFP4 as the gpt-oss release stores them "
                        "(gpt-oss only); nvfp4: compressed-tensors nvfp4-pack-quantized (llmcompressor's NVFP4A16) "
                        "for the Linear layers, not lm_head; int4: compressed-tensors pack-quantized INT4 in "
                        "groups of 32 for the routed experts only (Kimi-K2's scheme); a weight not in whole "
                        "groups stays unquantized")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(*_flag("--max_inflight"), dest="max_inflight", type=parse_size, default="512MiB",
                   help="memory budget per rank for pieces in flight (default 512MiB; a larger tensor goes alone)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where pieces travel under torchrun: cuda uses NCCL, cpu gloo (default: cuda if present)")
    p.add_argument(*_flag("--dist_timeout"), dest="dist_timeout", type=float, default=600.0,
                   help="seconds a rank waits for its peers before giving up (default 600)")
    p.add_argument(*_flag("--log_level"), dest="log_level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="what to log (default INFO)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


TARGET_HELP = "where the HF model goes (a folder, or a bucket's s3://, gs:// or az:// prefix); it appears whole or not at all"
SHARD_HELP = "largest output safetensors file (default 5GB; 200KB, 2GB, 2GiB or bytes)"
VERIFY_HELP = "before the final rename, re-read every written tensor and compare it with its source"
OVERWRITE_HELP = ("replace an earlier merger output at the target, or start over from a partial merge kept beside "
                  "it (never any other folder, never the source)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="merger", description="Turn distributed training checkpoints into HuggingFace models.",
                     epilog="merger COMMAND --help lists a command's flags; docs/options.md describes them all")
    parser.add_argument("--version", action="version", version=f"merger {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    merge = sub.add_parser("merge", help="merge a checkpoint into a HF model folder")
    _add_source_args(merge)
    _add_dtype_args(merge, "bfloat16", "as verl writes it")
    _add_quantize_args(merge)
    _add_target_args(merge)
    merge.add_argument(*_flag("--max_shard_size"), dest="max_shard_size", type=positive_size, default="5GB",
                       help=SHARD_HELP)
    merge.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    merge.add_argument(*_flag("--keep_partial"), dest="keep_partial", action="store_true",
                       help="on failure keep the staging folder .<target>.merger-partial (default: remove it; "
                            "Ctrl-C always keeps it)")
    merge.add_argument("--resume", action="store_true",
                       help="reuse the output files an interrupted merge finished (checksums in its manifest); "
                            "implies --keep-partial")
    merge.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    merge.add_argument(*_flag("--hf_upload_path"), dest="hf_upload_path", default=None, metavar="USER/NAME",
                       help="after a successful merge, create this Hugging Face Hub repo and upload the model")
    merge.add_argument("--private", action="store_true", help="with --hf_upload_path: create a private repo")
    merge.add_argument(*_flag("--summary_json"), dest="summary_json", type=local_path, default=None, metavar="PATH",
                       help="write a JSON summary: sizes, ranks, files, time, peak memory per rank, verify result")
    _add_run_args(merge)

    test = sub.add_parser("test", help="merge in memory and compare with a reference HF folder")
    _add_source_args(test)
    test.add_argument(*_flag("--test_hf_dir"), dest="test_hf_dir", type=local_path, required=True,
                      help="the HF model folder to compare the merge with")
    test.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bytes must match)")
    test.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    _add_run_args(test)

    lora = sub.add_parser("lora", help="fold PEFT adapter folders, in order, into a HF safetensors base model")
    lora.add_argument(*_flag("--base_model"), "--base", dest="local_dir", type=source_path, required=True,
                      metavar="DIR", help="HF model folder (safetensors) to fold the adapters into")
    lora.add_argument("--adapter", dest="adapters", type=source_path, action="append", required=True,
                      help="PEFT adapter folder; repeat to apply several in order")
    _add_target_args(lora)
    _add_dtype_args(lora, "keep", "the base's own, as PEFT's merge_and_unload")
    lora.add_argument(*_flag("--max_shard_size"), dest="max_shard_size", type=positive_size, default="5GB",
                      help=SHARD_HELP)
    lora.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    _add_run_args(lora)

    upload = sub.add_parser("upload", help="publish a folder a merge finished to the Hugging Face Hub (e.g. to retry "
                                           "a failed --hf_upload_path)")
    upload.add_argument(*_flag("--target_dir"), dest="target_dir", type=local_path, required=True,
                        help="the merged model: a folder with merge_manifest.json saying it is complete")
    upload.add_argument(*_flag("--hf_upload_path"), dest="hf_upload_path", required=True, metavar="USER/NAME",
                        help="Hub repo to create (kept if it exists) and upload into")
    upload.add_argument("--private", action="store_true", help="create a private repo")
    upload.add_argument("--debug", action="store_true", help="show tracebacks")

    watch = sub.add_parser("watch", help="convert each finished checkpoint of a training run into its own HF folder, "
                                         "once; keep watching for new ones")
    _add_source_args(watch, "the run folder, which holds a folder per saved step (global_step_N/, checkpoint-N/, "
                            "iter_N/, step-N/)")
    watch.add_argument(*_flag("--target_dir"), dest="target_dir", type=local_path, required=True,
                       help="where the steps go, each as TARGET_DIR/<step folder's name>")
    watch.add_argument("--role", choices=["actor", "critic"], default="actor",
                       help="verl runs: which model of global_step_N/ to convert (default actor)")
    watch.add_argument("--once", action="store_true",
                       help="convert what is finished now and exit (1 if a step failed); default: keep watching")
    watch.add_argument("--interval", type=float, default=60.0,
                       help="seconds between looks at the run folder (default 60)")
    _add_dtype_args(watch, "bfloat16", "as verl writes it")
    _add_quantize_args(watch)
    watch.add_argument(*_flag("--max_shard_size"), dest="max_shard_size", type=positive_size, default="5GB",
                       help=SHARD_HELP)
    watch.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    _add_run_args(watch)

    families = sub.add_parser("families", help="list the model families merger maps, and the frameworks each is "
                                               "mapped from (docs/families.md)")
    families.add_argument("--family", type=local_path, default=None, metavar="FILE",
                          help="instead, check this family file and show the rows it gives")
    families.add_argument("--debug", action="store_true", help="show tracebacks")

    inspect = sub.add_parser("inspect", help="describe a checkpoint and the planned output, reading no tensor data")
    _add_source_args(inspect)
    _add_dtype_args(inspect, "bfloat16", "as verl writes it")
    _add_quantize_args(inspect)
    inspect.add_argument(*_flag("--max_shard_size"), dest="max_shard_size", type=positive_size, default="5GB",
                         help=SHARD_HELP)
    inspect.add_argument(*_flag("--merge_ranks"), dest="merge_ranks", type=positive_int, default=1, metavar="N",
                         help="plan for N merge ranks (torchrun's --nproc_per_node times --nnodes): what each "
                              "reads, exchanges and writes")
    inspect.add_argument("--json", action="store_true", help="print the description as JSON")
    inspect.add_argument("--check", action="store_true",
                         help="instead of the description, read every source byte a merge reads that the format "
                              "checksums (torch.save CRC-32s; safetensors: offsets within the file) and name each "
                              "damaged or truncated file")
    inspect.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def merge_options(values: dict) -> MergeOptions:
    """The frozen options of a merge from a command's checked values (argparse's for the command line,
    keyword_values' for the API): the values of MergeOptions' fields, the command's other values left out."""
    fields = MergeOptions.__dataclass_fields__
    return MergeOptions(**{k: v for k, v in values.items() if k in fields})


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def keyword_values(command: str, keywords: dict) -> dict:
    """`command`'s options given as keyword arguments (the flags' names, `local_dir=...`): each value converted and
    checked by its flag's own type and choices, as its text on the command line would be, the rest at their flags'
    defaults; UsageError with the command line's line for an unknown name or a bad value.

    No command line is made or parsed: the command's parser serves as the table of its flags (names, conversions,
    choices, defaults), so that a flag and its keyword cannot drift apart."""
    parser = command_parsers(build_parser())[command]
    actions = {a.dest: a for a in reversed(parser._actions) if a.option_strings and a.dest != "help"}
    for key in keywords:
        if key not in actions:
            close = difflib.get_close_matches(key, actions, n=1)
            raise UsageError(f"unknown option {key}" + (f" (did you mean {close[0]}?)" if close else ""))
    values = {dest: _default(action) for dest, action in actions.items()}
    for key, value in keywords.items():
        action = actions[key]
        if action.nargs == 0:  # an on/off flag
            values[key] = action.const if value else action.default
        elif isinstance(action, argparse._AppendAction):  # repeated: a list of values
            values[key] = [_checked(action, v) for v in (value if isinstance(value, (list, tuple)) else [value])]
        elif value is not None:
            values[key] = _checked(action, value)
    missing = ["/".join(a.option_strings) for a in parser._actions if a.required and keywords.get(a.dest) is None]
    if missing:
        raise UsageError(f"the following arguments are required: {', '.join(missing)} ({parser.prog} --help lists "
                         f"every flag)")
    return values


def _default(action: argparse.Action):
    """A flag's value when it is not given: its default, converted as argparse converts a default given as text."""
    if isinstance(action.default, str) and action.type is not None:
        return _checked(action, action.default)
    return action.default


def _checked(action: argparse.Action, value):
    """`value` as the flag `action` takes its text: converted by its type, then held to its choices; a bad one is
    UsageError with argparse's line for it (`argument --dtype: invalid choice: 'int8' (choose from ...)`)."""
    text = str(value)
    try:
        converted = text if action.type is None else action.type(text)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"argument {'/'.join(action.option_strings)}: {e}") from None
    except (TypeError, ValueError):
        name = getattr(action.type, "__name__", repr(action.type))
        raise UsageError(f"argument {'/'.join(action.option_strings)}: invalid {name} value: {text!r}") from None
    if action.choices is not None and converted not in action.choices:
        raise UsageError(f"argument {'/'.join(action.option_strings)}: invalid choice: {converted!r} (choose from "
                         f"{', '.join(map(repr, action.choices))})")
    return converted
