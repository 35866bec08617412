"""Extraction's preflight: the disk its shards take, layer ids against the target's depth, the target
against the one the samples were made with, and the GPUs and port of the engine it starts
(`eagle3_core.preflight`)."""

from __future__ import annotations

from pathlib import Path

from eagle3_core.artifacts import SampleSet, TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.files import free_bytes
from eagle3_core.preflight import (
    conclude,
    device_gpus,
    disk_problem,
    engine_gpus,
    gpu_check,
    port_problem,
    server_gpus_source,
)
from eagle3_core.run_layout import RunLayout
from eagle3_core.server_defaults import concrete_server
from eagle3_core.target.preflight import layer_problem, target_files_problems, tensor_parallel_problem


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
        disk_problem(out_dir, needed, free, RunLayout.of(config).kept_results),
        layer_problem(layer_ids, target.num_layers, "extraction.layer_ids"),
        *target_files_problems(target),
        *sample_set_target_problems(sample_set, target),
        gpu_check(gpus, check_busy=vllm, why=server_gpus_source(config.server) if vllm else ""),
    ]
    if starts_engine and vllm:
        problems += [
            port_problem(config.server),
            tensor_parallel_problem(target, concrete_server(config.server, target.root_path).tensor_parallel_size),
        ]
    conclude("extraction", events, checks, problems)
