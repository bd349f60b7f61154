"""Shared fixtures: real checkpoints built once per session, and folders on other filesystems. The plumbing
they and the tests use (processes, in-process merges, output comparison) lives in tests/helpers."""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers.megatron_cases import CASES
from tests.helpers import warm_merger
from tests.helpers.processes import run_writer
from tests.helpers.torchtitan_writes import written_by_torchtitan

pytest_plugins = ["tests.helpers.timing_report"]  # the time per group and the slowest tests, after every run


# transformers binds FLA's Triton kernels (GPU only) in place of its torch Gated DeltaNet when it imports a model
# module while `import fla` works, so a Qwen3.5 forward on this CPU would fail or pass depending on which test
# imported the module first. The tests' process never imports FLA; torchtitan's writers, which need it, are
# processes of their own.
sys.modules["fla"] = None

# Tests send Ctrl-C (SIGINT) to the merger processes they start. A shell that starts the suite in the background
# (`make test &`, a CI step's `cmd &`) has it ignore SIGINT, and a child inherits an ignored signal, so merger would
# never see the Ctrl-C: Python's own handler makes the children start with SIGINT at its default again.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def other_filesystem(tmp_path):
    """A fresh folder in /dev/shm (tmpfs), on another filesystem than `tmp_path`; removed afterwards."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK) or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs a writable /dev/shm on another filesystem than the test's temporary folder")
    folder = Path(tempfile.mkdtemp(prefix="merger-test-", dir=shm))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def dcp_root(tmp_path_factory) -> Path:
    """plain/ (FSDP2 over 4 ranks, vocab 101), checkpoint-1/pytorch_model_fsdp_0 (HSDP 2x2, nested, with
    optimizer), hf/, reference/."""
    root = tmp_path_factory.mktemp("dcp")
    # Per interpreter: under Python 3.11.0-3.11.4 (Debian's 3.11.2) torch's own .metadata holds enums by name, and
    # test_dcp.py and test_megatron.py then merge that real form, not only a rewrite of the other interpreter's.
    run_writer("dcp_checkpoint.py", "--out", root, "--hsdp", "2,2", nproc=4, per_interpreter=True)
    return root


@pytest.fixture(scope="session")
def megatron_root(tmp_path_factory) -> Path:
    """ROOT/<case>/{legacy,torch_dist,hf} for every case of tests/helpers/megatron_cases.py, by megatron-core."""
    root = tmp_path_factory.mktemp("megatron")
    run_writer("megatron_checkpoint.py", "--out", root,
               *[arg for name, spec in CASES.items() for arg in ("--case", f"{name}:{spec}")], nproc=4,
               per_interpreter=True)  # as dcp_root: legacy rank files and .metadata hold the interpreter's enums
    return root


@pytest.fixture(scope="session")
def adapter_cases(tmp_path_factory) -> Path:
    """ROOT/<case>/{base, adapter folders..., oracle.pt}: tests/writers/peft_adapters.py's cases, with PEFT."""
    from tests.writers.peft_adapters import write_all

    root = tmp_path_factory.mktemp("peft_adapters")
    write_all(root)  # in this process: PEFT is imported here anyway, a subprocess would only add start-up time
    return root


@pytest.fixture(scope="session")
def ds_root(tmp_path_factory) -> Path:
    """ROOT/<case>/{out, hf, reference.pt}: tests/writers/deepspeed_checkpoint.py's ZeRO cases, by DeepSpeed."""
    root = tmp_path_factory.mktemp("deepspeed")
    run_writer("deepspeed_checkpoint.py", "--out", root, nproc=3, env={"DS_ACCELERATOR": "cpu"})
    return root


@pytest.fixture(scope="session")
def fsdp_checkpoint(tmp_path_factory):
    """fsdp_checkpoint(arch, world, mesh=None, tied=False, ...) -> (actor_dir, reference_dir), built once each."""
    cache: dict = {}

    def make(arch: str = "llama", world: int = 4, mesh: str | None = None, tied: bool = False,
             extra: tuple = ()) -> tuple[Path, Path]:
        key = (arch, world, mesh, tied, extra)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"fsdp_{arch}_w{world}")
            actor = root / "global_step_1" / "actor"
            args = ["--out", actor, "--reference", root / "reference", "--arch", arch]
            args += (["--mesh", mesh] if mesh else []) + (["--tied"] if tied else []) + list(extra)
            run_writer("fsdp_checkpoint.py", *args, nproc=world)
            cache[key] = (actor, root / "reference")
        return cache[key]

    return make


@pytest.fixture(scope="session")
def dcp_tp_root(tmp_path_factory) -> Path:
    """checkpoint/ (torch tensor parallelism over 2 ranks, hidden 512), reference/."""
    root = tmp_path_factory.mktemp("dcp_tp")
    run_writer("dcp_tp_checkpoint.py", "--out", root, nproc=2)
    return root


@pytest.fixture(scope="session")
def dcp_written(dcp_root, dcp_tp_root):
    """The DCP checkpoints torch writes for the suite, by name: "plain" (FSDP2 over 4 ranks), "checkpoint-1" (HSDP
    2x2 nested by accelerate, with optimizer state), "tp" (torch tensor parallelism over 2 ranks)."""
    return {"plain": dcp_root / "plain", "checkpoint-1": dcp_root / "checkpoint-1",
            "tp": dcp_tp_root / "checkpoint"}.__getitem__


@pytest.fixture(scope="session")
def deepseek_v3_root(tmp_path_factory) -> Path:
    """A torchtitan DeepSeek-V3 checkpoint (MLA, MoE, a float32 expert bias), shared by the tests of several files."""
    return written_by_torchtitan(tmp_path_factory, "deepseek_v3")


@pytest.fixture(scope="session")
def ct_release(tmp_path_factory):
    """ct_release(fmt) -> a tiny Llama quantized by compressed-tensors in `fmt`, written once each
    (tests/writers/compressed_tensors_release.py: a key of its FORMATS or VARIANTS)."""
    from tests.writers.compressed_tensors_release import write_release

    cache: dict[str, Path] = {}

    def make(fmt: str) -> Path:
        if fmt not in cache:
            cache[fmt] = write_release(tmp_path_factory.mktemp("compressed_tensors") / "release", fmt)
        return cache[fmt]

    return make


# the ModelOpt exports the tests read: (format, KV cache) -> the folder's name
MODELOPT_EXPORTS = {("nvfp4", None): "nvfp4", ("mxfp8", None): "mxfp8", ("nvfp4", "fp8"): "nvfp4_kv_fp8"}


@pytest.fixture(scope="session")
def mo_release(tmp_path_factory):
    """mo_release(fmt, kv_cache=None) -> a tiny Llama quantized and exported by ModelOpt in `fmt` (nvfp4, mxfp8),
    with an FP8 KV cache or none. Every export of MODELOPT_EXPORTS is written by one process of its own
    (tests/writers/modelopt_release.py), through the cache of written checkpoints: importing ModelOpt takes some
    15 s of CPU, which a test that only reads an export then never pays, and the writer pays once. Beside each
    export, never inside it, the writer saves ModelOpt's own dequantization of it, test_modelopt_read's oracle
    (`<folder>.oracle-f32.safetensors`, `<folder>.oracle-bf16.safetensors`)."""
    root = tmp_path_factory.mktemp("modelopt")
    specs = [f"{name}:{fmt}" + (f":{kv}" if kv else "") for (fmt, kv), name in MODELOPT_EXPORTS.items()]
    run_writer("modelopt_release.py", "--out", root, *[arg for spec in specs for arg in ("--export", spec)])

    def make(fmt: str, kv_cache: str | None = None) -> Path:
        return root / MODELOPT_EXPORTS[fmt, kv_cache]

    return make


@pytest.fixture(scope="session")
def peft_lora_checkpoint(tmp_path_factory) -> Path:
    """global_step_1/actor (verl FSDP, 2 ranks, a PEFT LoRA inside), lora_only/, reference/{adapter,merged}."""
    root = tmp_path_factory.mktemp("fsdp_lora")
    run_writer("fsdp_lora_checkpoint.py", "--out", root / "global_step_1" / "actor", "--lora-only", root / "lora_only",
               nproc=2)
    return root


@pytest.fixture(scope="session")
def llama34(tmp_path_factory) -> Path:
    """A save_pretrained Llama of 34 MiB in float32, its one safetensors file three multipart parts of PART bytes
    (the bucket target's tests)."""
    import torch
    import transformers

    from merger.output.bucket_target import PART

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("llama34") / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    assert (folder / "model.safetensors").stat().st_size > 2 * PART
    return folder


@pytest.fixture(scope="session")
def llama34_local(llama34, tmp_path_factory) -> Path:
    """The oracle of merges of llama34 into (or through) a bucket: it merged as float32 into a local
    folder, no object store in the way."""
    from tests.helpers.in_process import run_in_process

    local = tmp_path_factory.mktemp("llama34") / "local"
    run_in_process("merge", "--local_dir", llama34, "--target_dir", local, "--dtype", "float32")
    return local


@pytest.fixture(scope="session")
def s3_server():
    """An S3-protocol server (moto's) on the loopback, started once per run (per xdist worker that runs an object
    storage module): the modules share it, each in buckets of its own."""
    pytest.importorskip("moto", reason="moto[server] (a test extra) runs the S3 server of the object-storage tests")
    from tests.helpers.object_store import moto_server

    with moto_server() as server:
        yield server


@pytest.fixture(scope="session")
def gcs_server():
    """A GCS-protocol server (gcp-storage-emulator's, in memory) on the loopback, as s3_server."""
    pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator (a test extra) serves gs://")
    from tests.helpers.emulators import gcs_emulator

    with gcs_emulator() as server:
        yield server


@pytest.fixture(scope="session")
def azure_server():
    """An Azure Blob server (Azurite, from npm; `make azurite` installs it) on the loopback, as s3_server."""
    from tests.helpers.emulators import AZURITE, azurite, node_missing

    reason = node_missing()
    if reason:
        pytest.skip(reason)
    assert AZURITE.exists(), f"Azurite is not installed at {AZURITE}: run `make azurite` (make test does)"
    with azurite() as server:
        yield server


@pytest.fixture(autouse=True)
def _cold_starts_for_interpreter_tests(request):
    """Tests marked `interpreter` start merger as a fresh interpreter does; the others fork it warm
    (tests/helpers/warm_merger.py)."""
    warm_merger.allowed = request.node.get_closest_marker("interpreter") is None
    yield
    warm_merger.allowed = True


@pytest.fixture(scope="session")
def deepseek_v4(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny DeepSeek-V4 release, FP8 with FP4 experts: tests/writers/deepseek_v4_release.py; the model merger
    reads from it, bfloat16), shared by the read and write tests."""
    from tests.helpers.in_process import merge_in_process
    from tests.writers.deepseek_v4_release import write_release

    root = tmp_path_factory.mktemp("deepseek_v4")
    return write_release(root / "release"), merge_in_process(root / "release", root / "bf16")
