"""Command line: `merger merge|test|inspect|lora`, with verl's flag spellings (`--local_dir`) and dashed ones.

Runs the same on one process and under torchrun/Slurm: the process group comes from the environment.
Errors reach the user as one line `merger: error: <what>, <which file>` and exit code 1.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from .engine.dist import init_group
from .engine.torchrun_error import record_for_torchrun
from .errors import AgreedError, MergerError
from .mapping.torchtitan import MODELS
from .options import DTYPES, MergeOptions
from .sources import BACKENDS
from .units import format_size, parse_size, positive_int


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

    def error(self, message):
        parser = self._command_parser()
        known = [s for s in parser._option_string_actions if s.startswith("--")] if parser else []
        for arg in self._args if parser else []:
            flag = arg.split("=", 1)[0]
            if flag.startswith("--") and not any(s.startswith(flag) for s in known):  # abbreviations are known
                close = difflib.get_close_matches(flag, known, n=1)
                message += f"; unknown flag {flag}" + (f" (did you mean {close[0]}?)" if close else "")
        super().error(message)


def _flag(*names: str) -> list[str]:
    """verl spells flags with underscores; accept both `--local_dir` and `--local-dir`."""
    out = []
    for name in names:
        out += [name, name.replace("_", "-")] if "_" in name else [name]
    return list(dict.fromkeys(out))


def _add_source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(*_flag("--local_dir"), dest="local_dir", type=Path, required=True,
                   help="the checkpoint folder (e.g. global_step_100/actor)")
    p.add_argument("--backend", default="auto", choices=["auto", *BACKENDS],
                   help="checkpoint format (default auto: detect it)")
    p.add_argument("--prefix", default=None,
                   help="DCP: prefix to take off tensor names and keep only those under it, e.g. 'model' "
                        "(default: 'model.' when accelerate nested the state dict; '' keeps names as saved)")
    p.add_argument("--model", choices=["auto", "hf", *MODELS], default="auto",
                   help="naming of the source tensors (default: detect; torchtitan-<family> converts torchtitan's "
                        "names to HF's and needs --hf_model_config_path)")
    p.add_argument(*_flag("--hf_model_config_path"), dest="hf_model_config_path", default=None,
                   help="folder with config.json, tokenizer, processor, chat template, remote code, or a Hub model "
                        "id (owner/name; default: huggingface/ in the checkpoint)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                   help="output dtype of floating tensors (default bfloat16, as verl); keep = source dtype")
    _add_overflow_arg(p)
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
    p.add_argument(*_flag("--base_model"), dest="base_model", default=None,
                   help="adapter-only checkpoints (accelerate adapter_only DCP, verl save_lora_only): HF "
                        "safetensors folder, or Hub model id, to fold the adapter into (default: write the adapter "
                        "as a PEFT adapter folder)")
    p.add_argument(*_flag("--adapter_config"), dest="adapter_config", type=Path, default=None,
                   help="checkpoints with a LoRA adapter: its adapter_config.json, file or folder (r, lora_alpha, "
                        "use_rslora, rank/alpha patterns; default: checkpoint-N/ and its parent for accelerate, "
                        "lora_train_meta.json and the tensors for verl)")


def _add_overflow_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(*_flag("--allow_overflow"), dest="allow_overflow", action="store_true",
                   help="with --dtype float16: write inf for values beyond float16's range (default: fail, "
                        "naming the tensors)")


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


TARGET_HELP = "where the HF model goes; it appears whole or not at all"
SHARD_HELP = "largest output safetensors file (default 5GB; 200KB, 2GB, 2GiB or bytes)"
OVERWRITE_HELP = "replace an earlier merger output at the target (never any other folder, never the source)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="merger", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    merge = sub.add_parser("merge", help="merge a checkpoint into a HF model folder")
    _add_source_args(merge)
    merge.add_argument(*_flag("--target_dir"), dest="target_dir", type=Path, required=True, help=TARGET_HELP)
    merge.add_argument(*_flag("--max_shard_size"), dest="max_shard_size", type=parse_size, default="5GB",
                       help=SHARD_HELP)
    merge.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    merge.add_argument(*_flag("--keep_partial"), dest="keep_partial", action="store_true",
                       help="on failure keep the staging folder .<target>.merger-partial (default: remove it)")
    merge.add_argument("--resume", action="store_true",
                       help="reuse the output files an interrupted merge finished (checksums in its manifest); "
                            "implies --keep-partial")
    merge.add_argument("--verify", action="store_true",
                       help="before the final rename, re-read every written tensor and compare it with its source")
    merge.add_argument(*_flag("--hf_upload_path"), dest="hf_upload_path", default=None, metavar="USER/NAME",
                       help="after a successful merge, create this Hugging Face Hub repo and upload the model")
    merge.add_argument("--private", action="store_true", help="with --hf_upload_path: create a private repo")
    merge.add_argument(*_flag("--summary_json"), dest="summary_json", type=Path, default=None, metavar="PATH",
                       help="write a JSON summary: sizes, ranks, files, time, peak memory per rank, verify result")
    _add_run_args(merge)

    test = sub.add_parser("test", help="merge in memory and compare with a reference HF folder")
    _add_source_args(test)
    test.add_argument(*_flag("--test_hf_dir"), dest="test_hf_dir", type=Path, required=True,
                      help="the HF model folder to compare the merge with")
    test.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bytes must match)")
    test.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    _add_run_args(test)

    lora = sub.add_parser("lora", help="fold PEFT adapter folders, in order, into a HF safetensors base model")
    lora.add_argument("--base", dest="local_dir", type=Path, required=True, help="HF model folder (safetensors)")
    lora.add_argument("--adapter", dest="adapters", type=Path, action="append", required=True,
                      help="PEFT adapter folder; repeat to apply several in order")
    lora.add_argument(*_flag("--target_dir"), dest="target_dir", type=Path, required=True, help=TARGET_HELP)
    lora.add_argument("--dtype", choices=list(DTYPES), default="keep",
                      help="output dtype of floating tensors (default keep: the base's dtype, as PEFT)")
    _add_overflow_arg(lora)
    lora.add_argument(*_flag("--max_shard_size"), dest="max_shard_size", type=parse_size, default="5GB",
                      help=SHARD_HELP)
    lora.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    _add_run_args(lora)

    upload = sub.add_parser("upload", help="publish a folder a merge finished to the Hugging Face Hub (e.g. to retry "
                                           "a failed --hf_upload_path)")
    upload.add_argument(*_flag("--target_dir"), dest="target_dir", type=Path, required=True,
                        help="the merged model: a folder with merge_manifest.json saying it is complete")
    upload.add_argument(*_flag("--hf_upload_path"), dest="hf_upload_path", required=True, metavar="USER/NAME",
                        help="Hub repo to create (kept if it exists) and upload into")
    upload.add_argument("--private", action="store_true", help="create a private repo")
    upload.add_argument("--debug", action="store_true", help="show tracebacks")

    inspect = sub.add_parser("inspect", help="describe a checkpoint and the planned output, reading no tensor data")
    _add_source_args(inspect)
    inspect.add_argument(*_flag("--max_shard_size"), dest="max_shard_size", type=parse_size, default="5GB",
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


def options_from_args(args: argparse.Namespace) -> MergeOptions:
    fields = MergeOptions.__dataclass_fields__
    return MergeOptions(**{k: v for k, v in vars(args).items() if k in fields})


def _inspect(options: MergeOptions, as_json: bool, merge_ranks: int) -> int:
    from .engine.dist import Group
    from .merge import prepare
    from .engine.plan import rerouted, traffic

    prepared = prepare(options, Group())
    c, plan = prepared.catalog, rerouted(prepared.plan, prepared.catalog, world=merge_ranks)
    info = {
        "format": c.format, "root": str(c.root), "source_files": len(c.files), **c.details,
        "tensors": len(c.tensors), "source_bytes": c.nbytes, "hf_dir": str(prepared.hf_dir),
        "output_dtype": options.dtype, "output_tensors": len(plan.location), "output_bytes": plan.total_bytes,
        "output_files": [{"name": f.name, "bytes": f.size, "tensors": len(f.entries)} for f in plan.files],
        "merge_ranks": merge_ranks, "bytes_per_rank": traffic(plan),
        "notes": [note.removeprefix("merger: ") for note in prepared.notes],  # what the mapping found and does
    }
    if c.skipped:  # formats that name their skip rules (Megatron): stored name -> rule
        info["skipped"] = c.skipped
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for key, value in info.items():
        if key == "output_files":
            print("output_files:")
            for f in value:
                print(f"  {f['name']}  {format_size(f['bytes'])}  {f['tensors']} tensors")
        elif key == "bytes_per_rank":
            print("bytes_per_rank:")
            for rank, moved in enumerate(value):
                print(f"  rank {rank}: " + ", ".join(f"{what.removesuffix('_bytes')} {format_size(n)}"
                                                      for what, n in moved.items()))
        elif key == "notes":
            for note in value:
                print(f"note: {note}")
        elif key == "skipped":
            _print_skipped(value)
        elif key.endswith("bytes"):
            print(f"{key}: {value} ({format_size(value)})")
        else:
            print(f"{key}: {value}")
    return 0


def _check_sources(options: MergeOptions) -> int:
    """`inspect --check`: one error line per bad file, or one line saying what was checked (rank 0 prints)."""
    from .engine.source_check import check_sources
    from .merge import prepare

    group = init_group("cpu", options.dist_timeout)  # control messages only: gloo
    try:
        result = check_sources(prepare(options, group).catalog, group, options.debug)
    finally:
        group.close()
    for line in result.bad.values():
        _fail(line, show=group.rank == 0)
    if not result.bad and group.rank == 0:
        print(f"checked {result.files} source files, {result.bytes} bytes ({format_size(result.bytes)}) of tensor "
              f"data: all fine")
    return 1 if result.bad else 0


def _print_skipped(skipped: dict[str, str]) -> None:
    """One line per rule: how many stored entries it left out, and the first of them (--json lists them all)."""
    by_rule: dict[str, list[str]] = {}
    for name, rule in skipped.items():
        by_rule.setdefault(rule, []).append(name)
    print(f"skipped: {len(skipped)} stored entries (--json lists each)")
    for rule, names in by_rule.items():
        print(f"  {rule}: {len(names)}, e.g. {names[0]}")


def _run(args: argparse.Namespace) -> int:
    if args.command == "upload":
        from .output.publish import publish_folder

        print(publish_folder(args.target_dir.absolute(), args.hf_upload_path, args.private))
        return 0
    options = options_from_args(args)
    if args.command == "inspect":
        return _check_sources(options) if args.check else _inspect(options, args.json, args.merge_ranks)
    with _one_intra_op_thread():
        return _run_on_group(args, options)


@contextlib.contextmanager
def _one_intra_op_thread():
    """torch's intra-op pool off while merging, unless OMP_NUM_THREADS asks otherwise (torchrun sets it to 1).

    The merge keeps the cores busy with threads of its own (reading and casting, writing, hashing). A cast
    split over torch's pool on top of them waits for workers those threads keep off the cores: a 1-process
    merge on 2 cores ran 2-3x slower with the pool than without."""
    import torch

    previous = torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)  # an in-process caller (tests, notebooks) gets its pool back


def _run_on_group(args: argparse.Namespace, options: MergeOptions) -> int:
    group = init_group(options.device, options.dist_timeout)
    try:
        if args.command in ("merge", "lora"):
            from .merge import run_merge

            run_merge(options, group)  # `lora`: options.adapters name the adapter folders to fold in
            return 0
        from .engine.compare import compare_with_folder
        from .merge import prepare

        options.dtype = "keep"  # compare in the reference's own dtype: each tensor is cast to it
        prepared = prepare(options, group)
        result = compare_with_folder(prepared.plan, prepared.catalog, group, args.test_hf_dir, atol=args.atol,
                                     rtol=args.rtol, debug=options.debug)
        return 0 if result.ok else 1
    except KeyboardInterrupt as e:
        if str(e) == "SIGTERM":  # under torchrun: its agent stops the others when a rank dies; say which died
            group.explain_interrupt()
        raise
    finally:
        group.close()


def _terminated(signum, frame):
    # torchrun and Slurm stop a job with SIGTERM: unwind like Ctrl-C, so the staging folder is cleaned up.
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _fail(message: str, code: int = 1, show: bool = True) -> int:
    """The `merger: error:` line on stderr (when this rank shows it) and, under torchrun, in its error record."""
    line = f"merger: error: {message}"
    if show:
        print(line, file=sys.stderr)
    record_for_torchrun(line)
    return code


def command() -> NoReturn:
    """The `merger` command and `python -m merger`: main(), then the process ends without tearing down the
    interpreter. Freeing torch's modules and objects one by one at exit took 0.4 s of every process on this
    project's 2-core VM (a process that only imports merger: 1.45 s, 1.07 s without the teardown), a second
    for each pair of ranks. By then main() has closed every file, the process group and its threads; what is
    left in Python's buffers is flushed here. In-process callers use main(), which returns."""
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the reader is gone (`merger inspect ... | head`) or the stream closed
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "INFO"), format="%(message)s", stream=sys.stderr)
    in_main_thread = threading.current_thread() is threading.main_thread()  # only there can handlers be set
    previous = signal.signal(signal.SIGTERM, _terminated) if in_main_thread else None
    try:
        return _run(args)
    except AgreedError as e:
        # Every rank raised the same line at a sync point: print it once, from rank 0.
        return _fail(str(e), show=os.environ.get("RANK", "0") == "0")
    except MergerError as e:
        return _fail(str(e))
    except KeyboardInterrupt as e:
        rank = f" (rank {os.environ['RANK']})" if "RANK" in os.environ else ""
        return _fail(f"interrupted by {str(e) or 'SIGINT'}{rank}", code=130)  # Ctrl-C's KeyboardInterrupt has no args
    except Exception as e:  # noqa: BLE001 - a bug still gets one line unless --debug
        if args.debug:
            raise
        return _fail(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)")
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
