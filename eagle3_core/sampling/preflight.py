"""Sampling's preflight: the disk its rows take, the target's files, and the port and GPUs of the server
it starts (`eagle3_core.preflight`)."""

from __future__ import annotations

from pathlib import Path

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.files import free_bytes
from eagle3_core.preflight import conclude, disk_problem, engine_gpus, gpu_check, port_problem, server_gpus_source
from eagle3_core.run_layout import RunLayout
from eagle3_core.server_defaults import concrete_server
from eagle3_core.target.preflight import target_files_problems, tensor_parallel_problem

# A sampled row on disk (ids, mask, text, Parquet overhead) per token, rounded up: sampling's estimate.
SAMPLE_BYTES_PER_TOKEN = 32


def preflight_sampling(
    config: PipelineConfig, target: TargetModel, out_dir: Path, prompts: int, starts_server: bool, events: RunEvents
) -> None:
    """`starts_server`: the phase starts its server, or the shared one (`eagle3_core.serving.shared`), unless
    `server.engine` is external."""
    starts_engine = starts_server and config.server.engine == "vllm"
    needed = prompts * (config.sampling.max_tokens + config.server.max_model_len // 4) * SAMPLE_BYTES_PER_TOKEN
    free = free_bytes(out_dir)
    gpus = engine_gpus(config) if starts_engine else 0
    checks = {"disk_needed": needed, "disk_free": free, "gpus": gpus, "port": config.server.port}
    problems = [disk_problem(out_dir, needed, free, RunLayout.of(config).kept_results), *target_files_problems(target)]
    if starts_engine:
        problems += [
            port_problem(config.server),
            gpu_check(gpus, True, server_gpus_source(config.server)),
            tensor_parallel_problem(target, concrete_server(config.server, target.root_path).tensor_parallel_size),
        ]
    conclude("sampling", events, checks, problems)
