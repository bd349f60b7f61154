"""DeepSpeed ZeRO checkpoints merged to HF, checked against DeepSpeed's own zero_to_fp32.

Real DeepSpeed writes every checkpoint (tests/writers/deepspeed_checkpoint.py, one torchrun launch of 3 gloo
ranks on the CPU accelerator): stage 1 (HF Trainer), 2 and 3, bf16 and fp32, tied embeddings, a frozen module.
The oracle is `get_fp32_state_dict_from_zero_checkpoint`'s output, saved by the writer: the fp32 merge must
equal it bit for bit, from one process and from 3 torchrun ranks.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.in_process import merge_here, merge_in_process, single_error_line
from tests.helpers.processes import run, run_merger, run_merger_leaving_no_thread
from tests.helpers.weights import load_safetensors_folder
from tests.writers.deepspeed_checkpoint import BUFFER, CASES

pytestmark = pytest.mark.slow

TIED = {name for name, (_, _, tied, _, _) in CASES.items() if tied}


def source(root: Path, case: str) -> tuple[Path, list[str]]:
    """The folder to merge and the flags it needs: HF Trainer's checkpoint-N/ carries its own config.json."""
    if CASES[case][4]:
        return root / case / "out" / "checkpoint-1", []
    return root / case / "out", ["--hf_model_config_path", root / case / "hf"]


@pytest.fixture(scope="session")
def merged(ds_root, tmp_path_factory):
    """merged(case) -> the fp32 merge of ROOT/case with one process, built once."""
    cache: dict = {}

    def make(case: str) -> Path:
        if case not in cache:
            folder, flags = source(ds_root, case)
            cache[case] = merge_in_process(folder, tmp_path_factory.mktemp(case) / "hf", *flags, "--dtype", "float32")
        return cache[case]

    return make


def assert_matches_zero_to_fp32(merged_dir: Path, root: Path, case: str) -> dict[str, torch.Tensor]:
    """Every tensor zero_to_fp32 reconstructs is in the merge, bit for bit (a tied lm_head written once, as
    save_pretrained does); returns what the merge holds beyond it."""
    ours = load_safetensors_folder(merged_dir)
    reference = torch.load(root / case / "reference.pt", weights_only=True)
    if case in TIED:
        assert "lm_head.weight" not in ours and torch.equal(reference.pop("lm_head.weight"),
                                                            reference["model.embed_tokens.weight"])
    for name, want in reference.items():
        # frozen params keep the training dtype in zero_to_fp32's output: compared as the fp32 merge holds them
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], want.float()), name
    return {name: t for name, t in ours.items() if name not in reference}


@pytest.mark.parametrize("case", sorted(CASES))
def test_merge_equals_zero_to_fp32(ds_root, merged, case):
    import transformers

    extra = assert_matches_zero_to_fp32(merged(case), ds_root, case)
    if CASES[case][4]:
        # HF Trainer's stage 1 bf16 save lists its frozen module in no frozen_param_shapes, so zero_to_fp32
        # drops it; the merge takes it from the saved module, as the Trainer's own model.safetensors holds it.
        from safetensors.torch import load_file

        trainer = load_file(source(ds_root, case)[0] / "model.safetensors")
        assert sorted(extra) == [f"model.layers.0.mlp.{p}_proj.weight" for p in ("down", "gate", "up")]
        assert all(torch.equal(t.bfloat16(), trainer[name]) for name, t in extra.items())
    else:
        assert not extra
    model, info = transformers.AutoModelForCausalLM.from_pretrained(merged(case), output_loading_info=True)
    assert not info["missing_keys"] and set(info["unexpected_keys"]) == {BUFFER}, info  # the writer's extra buffer


@pytest.mark.parametrize("case, ranks", [("s3_fp32_tied_frozen", 3), ("s2_fp32_frozen", 2)])
def test_torchrun_ranks(ds_root, merged, tmp_path, case, ranks):
    """3 merge ranks over 3 partitions (6 files at stage 3) and 2 over 3 (4 files at stage 2), small shards: the
    same tensors as one process, and every rank returns leaving no thread behind."""
    folder, flags = source(ds_root, case)
    run_merger_leaving_no_thread("merge", "--local_dir", folder, "--target_dir", tmp_path / "hf", *flags,
                                 "--dtype", "float32", "--max_shard_size", "30000", nproc=ranks)
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    assert not assert_matches_zero_to_fp32(tmp_path / "hf", ds_root, case)
    ones = load_safetensors_folder(merged(case))
    assert all(torch.equal(t, ones[name]) for name, t in load_safetensors_folder(tmp_path / "hf").items())


def test_every_local_dir_layout(ds_root, merged, tmp_path):
    """The output dir (follows `latest`: the `merged` fixture), global_stepN/ itself, and HF Trainer's
    checkpoint-N/ and its global_stepN/ (config.json found one level up) merge to the same tensors."""
    s2 = ds_root / "s2_fp32_frozen"
    trainer_step = source(ds_root, "trainer_s1_bf16")[0] / "global_step1"
    for case, folder, flags in [("s2_fp32_frozen", s2 / "out" / "global_step1", ["--hf_model_config_path", s2 / "hf"]),
                                ("trainer_s1_bf16", trainer_step, [])]:
        got = load_safetensors_folder(merge_in_process(folder, tmp_path / case, *flags, "--dtype", "float32"))
        want = load_safetensors_folder(merged(case))
        assert got.keys() == want.keys() and all(torch.equal(t, want[n]) for n, t in got.items()), case


def test_trainer_output_dir_names_its_checkpoint(ds_root, tmp_path, capsys):
    """HF Trainer's output_dir holds checkpoint-N/ folders and no `latest`: the one error line names the latest one
    (the highest N) to pass."""
    out = ds_root / "trainer_s1_bf16" / "out"
    code, errors = merge_here(capsys, "--local_dir", out, "--target_dir", tmp_path / "hf")
    assert code != 0 and len(errors) == 1, errors
    assert errors[0].endswith(f"it looks like a training run's folder: pass its latest checkpoint (deepspeed), "
                              f"--local_dir {out / 'checkpoint-1'}"), errors


def test_default_bf16_equals_trainer_save(ds_root, tmp_path):
    """The default --dtype bfloat16: HF Trainer's own model.safetensors (its bf16 model) bit for bit."""
    from safetensors.torch import load_file

    folder = source(ds_root, "trainer_s1_bf16")[0]
    ours = load_safetensors_folder(merge_in_process(folder, tmp_path / "hf"))
    trainer = load_file(folder / "model.safetensors")
    assert ours.keys() == trainer.keys() and all(torch.equal(ours[n], trainer[n]) for n in trainer)


def test_never_imports_deepspeed(ds_root, tmp_path):
    folder, flags = source(ds_root, "s3_bf16_frozen")
    code = ("import sys; from merger.cli import main; "
            f"assert main(['merge', '--local_dir', {str(folder)!r}, '--target_dir', {str(tmp_path / 'hf')!r}, "
            f"'--hf_model_config_path', {str(flags[1])!r}]) == 0; "
            "assert not [m for m in sys.modules if m.startswith('deepspeed')], 'deepspeed was imported'")
    run([sys.executable, "-c", code])


def copy_case(root: Path, case: str, tmp_path: Path) -> Path:
    dest = tmp_path / case
    shutil.copytree(root / case, dest)
    return dest


def test_truncated_partition_is_one_error_from_three_ranks(ds_root, tmp_path):
    """Found from the file's own zip directory before anything is read (#52 finding 9), by the rank that owns it."""
    case = copy_case(ds_root, "s3_bf16_frozen", tmp_path)
    part = case / "out" / "global_step1" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with open(part, "r+b") as f:
        f.truncate(part.stat().st_size // 2)
    proc = run_merger("merge", "--local_dir", case / "out", "--target_dir", tmp_path / "hf",
                      "--hf_model_config_path", case / "hf", nproc=3, check=False, timeout=120)
    assert proc.returncode != 0
    line = single_error_line(proc.stderr)
    assert "rank 1: truncated" in line and line.endswith(str(part)), line
    # no rank prints a traceback from merger's code
    assert not [l for l in proc.stderr.splitlines() if l.strip().startswith("File") and "/merger/" in l]
    assert not (tmp_path / "hf").exists()


def test_a_latest_tag_linked_out_of_the_checkpoint_is_refused(ds_root, tmp_path):
    """`latest` names the step folder: a link leading out of the checkpoint is never followed."""
    case = copy_case(ds_root, "s2_fp32_frozen", tmp_path)
    step = case / "out" / "global_step1"
    step.symlink_to(step.rename(tmp_path / "elsewhere"))
    proc = run_merger("merge", "--local_dir", case / "out", "--target_dir", tmp_path / "hf",
                      "--hf_model_config_path", case / "hf", check=False)
    assert proc.returncode == 1
    line = single_error_line(proc.stderr)
    assert "latest names 'global_step1', which lies outside the checkpoint folder" in line, line
    assert line.endswith(str(case / "out" / "latest")) and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("extra, says", [
    ("zero_pp_rank_0_mp_rank_01_optim_states.pt", "model-parallel"),
    ("layer_01-model_states.pt", "pipeline-parallel"),
    ("layer_0_expert_0_mp_rank_00_model_states.pt", "MoE"),
])
def test_model_parallel_is_refused(ds_root, tmp_path, capsys, extra, says):
    """A file of a layout merger does not read (copied from a real one: only its name matters) is named."""
    case = copy_case(ds_root, "s2_fp32_frozen", tmp_path)
    step = case / "out" / "global_step1"
    shutil.copy(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt", step / extra)
    code, errors = merge_here(capsys, "--local_dir", case / "out", "--target_dir", tmp_path / "hf",
                              "--hf_model_config_path", case / "hf")
    assert code != 0 and len(errors) == 1 and errors[0].endswith(str(step / extra)), errors
    assert says in errors[0] and not (tmp_path / "hf").exists()


def test_foreign_global_in_optim_states_is_refused(ds_root, tmp_path, capsys):
    """Only the three DeepSpeed names map to stand-ins: any other global is refused before it is called."""
    case = copy_case(ds_root, "s2_fp32_frozen", tmp_path)
    part = case / "out" / "global_step1" / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    data = part.read_bytes()
    renamed = data.replace(b"deepspeed.runtime.fp16.loss_scaler\nLossScaler",
                           b"deepspeed.runtime.fp16.loss_scaler\nLossScalet")
    assert renamed != data
    part.write_bytes(renamed)
    code, errors = merge_here(capsys, "--local_dir", case / "out", "--target_dir", tmp_path / "hf",
                              "--hf_model_config_path", case / "hf")
    assert code != 0 and len(errors) == 1 and "LossScalet" in errors[0] and errors[0].endswith(str(part)), errors
