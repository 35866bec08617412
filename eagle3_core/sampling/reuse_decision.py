"""Whether sampling and extraction share one vLLM server (`extraction.reuse_sampling_server`).

`off` keeps two engines (sampling's, then extraction's); `on` shares one; `auto` shares one when the engine
start it saves outweighs the slower sampling on a server that carries the hidden-states connector:

    reuse  <=>  load_s > sampling_s * penalty / (1 - penalty)

- `load_s`: the last engine start of this target recorded in events.jsonl (WEIGHT_LOAD, the time until the
  server was healthy), else a fixed start-up cost, `extraction.reuse_engine_start_s`, plus the size of its
  weights on disk at `extraction.reuse_load_gb_per_s` (the weights alone said 1 s for SmolLM2, whose engine
  took 61 s to be healthy on 2 cores);
- `sampling_s`: the requests still to make (responses without an ok row) at the seconds per request of the
  last sampling run recorded in events.jsonl, else at `sampling.max_tokens` tokens each and
  `extraction.reuse_generation_tokens_per_s`;
- `penalty`: `extraction.reuse_generation_penalty`, the share of generation tokens/s the connector costs.

The choice is recorded with these numbers as one DECISION line in events.jsonl.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import ConfigError, PipelineConfig
from eagle3_core.events import DECISION, WEIGHT_LOAD, RunEvents
from eagle3_core.phases import SAMPLING
from eagle3_core.sampling.prompts import load_prompts
from eagle3_core.sampling.store import SampleStore

PHASE = SAMPLING.name


@dataclass(frozen=True)
class ReuseEstimate:
    """The numbers `auto` decides on, and where each came from."""

    load_s: float
    load_source: str
    sampling_s: float
    sampling_source: str
    penalty: float

    @property
    def slowdown_s(self) -> float:
        """Seconds sampling takes longer on the shared server."""
        return sampling_slowdown_s(self.sampling_s, self.penalty)

    @property
    def reuse(self) -> bool:
        return reuse_saves_time(self.load_s, self.sampling_s, self.penalty)


def sampling_slowdown_s(sampling_s: float, penalty: float) -> float:
    """Extra seconds of `sampling_s` worth of generation at (1 - penalty) of the tokens/s."""
    return sampling_s * penalty / (1 - penalty)


def reuse_saves_time(load_s: float, sampling_s: float, penalty: float) -> bool:
    """True when the engine start saved outweighs the slower sampling."""
    return load_s > sampling_slowdown_s(sampling_s, penalty)


def last_engine_start_s(events: list[dict[str, Any]], model_dir: Path) -> float | None:
    """Seconds until healthy of the last vLLM start of `model_dir` in the event log, else None."""
    loads = [e for e in events if e["event"] == WEIGHT_LOAD and str(model_dir) in str(e.get("what", ""))]
    if not loads:
        return None
    return float(loads[-1].get("startup_s", loads[-1]["seconds"]))


def last_seconds_per_request(events: list[dict[str, Any]]) -> float | None:
    """Seconds per request (one response; the line's `prompts`) of the last sampling run in the event log,
    else None."""
    runs = [e for e in events if e["phase"] == PHASE and e["event"] == DECISION and e.get("prompts")]
    return runs[-1]["seconds"] / runs[-1]["prompts"] if runs else None


def weights_bytes(model_dir: Path) -> int:
    return sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))


def pending_requests(config: PipelineConfig, target: TargetModel) -> int:
    """Responses without an ok row in `<run_dir>/samples` made with the same target and parameters."""
    prompts = load_prompts(config.sampling.prompt_files, config.sampling.max_prompts)
    store = SampleStore.of_run(config, target, prompts, RunEvents(config.run_dir))
    ok = store.ok_ids()
    return sum(sample not in ok for sample in store.sample_ids(prompts))


def estimate_reuse(config: PipelineConfig, target: TargetModel, events: list[dict[str, Any]]) -> ReuseEstimate:
    extraction = config.extraction
    load_s = last_engine_start_s(events, target.root_path)
    if load_s is not None:
        load_source = "last engine start in events.jsonl"
    else:
        size = weights_bytes(target.root_path)
        load_s = extraction.reuse_engine_start_s + size / (extraction.reuse_load_gb_per_s * 1e9)
        load_source = (
            f"no engine start in events.jsonl: {extraction.reuse_engine_start_s:.0f} s start-up "
            f"(extraction.reuse_engine_start_s) + {size / 1e9:.2f} GB of weights at "
            f"{extraction.reuse_load_gb_per_s} GB/s"
        )
    pending = pending_requests(config, target)
    per_request = last_seconds_per_request(events)
    if per_request is not None:
        sampling_source = f"{pending} requests at {per_request:.2f} s each (last sampling run)"
    else:
        per_request = config.sampling.max_tokens / extraction.reuse_generation_tokens_per_s
        sampling_source = (
            f"{pending} requests of {config.sampling.max_tokens} tokens at "
            f"{extraction.reuse_generation_tokens_per_s:.0f} tokens/s"
        )
    penalty = extraction.reuse_generation_penalty
    return ReuseEstimate(load_s, load_source, pending * per_request, sampling_source, penalty)


def reuse_supported(config: PipelineConfig) -> bool:
    """Only a vLLM server this pipeline starts can also extract with the vllm backend."""
    return config.extraction.backend == "vllm" and config.server.engine == "vllm"


def resolve_reuse(config: PipelineConfig, target: TargetModel, events: RunEvents) -> bool:
    """Whether sampling and extraction share one server; `on` and `auto` record why (see module docstring)."""
    mode = config.extraction.reuse_sampling_server
    if mode == "off":
        return False
    if not reuse_supported(config):
        if mode == "on":
            raise ConfigError(
                "extraction.reuse_sampling_server is 'on' but sharing needs extraction.backend 'vllm' and "
                f"server.engine 'vllm' (got {config.extraction.backend!r}, {config.server.engine!r})"
            )
        events.record(PHASE, DECISION, "reuse_sampling_server=auto: separate engines (no vLLM server to share)")
        return False
    if mode == "on":
        events.record(PHASE, DECISION, "reuse_sampling_server=on: sampling and extraction share one vLLM server")
        return True
    estimate = estimate_reuse(config, target, events.read())
    choice = "one shared server" if estimate.reuse else "separate engines"
    events.record(
        PHASE,
        DECISION,
        f"reuse_sampling_server=auto: {choice} (engine start {estimate.load_s:.0f} s vs sampling "
        f"{estimate.slowdown_s:.0f} s slower: {estimate.sampling_s:.0f} s at {estimate.penalty:.0%} fewer tokens/s)",
        reuse=estimate.reuse,
        slowdown_s=estimate.slowdown_s,
        **asdict(estimate),
    )
    return estimate.reuse
