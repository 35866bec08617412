"""The numbers of a plan, each a pure function: tokens a run will sample, the disk its hidden states take
(stored, or online's buffer), the GPU memory of each engine rank, and the training steps.

Before sampling, a sample's tokens are expected, not known: its prompt at `CHARS_PER_TOKEN` characters a
token (plus `MESSAGE_OVERHEAD_TOKENS` of chat template a message), and a response of `sampling.max_tokens`
capped at `TYPICAL_RESPONSE_TOKENS`: the seeds' 10,000 Kimi-K2.5 reasoning responses came to 21M tokens,
2,100 a sample, at max_tokens 16,384. Once a SampleSet exists, its own token count is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eagle3_core.config import ServerConfig, TrainingConfig
from eagle3_core.devices import DeviceFacts
from eagle3_core.hidden_states.storage import bytes_per_token
from eagle3_core.model_size import ModelSize
from eagle3_core.sampling.prompts import Prompt

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 8
TYPICAL_RESPONSE_TOKENS = 2_100


@dataclass(frozen=True)
class TokenEstimate:
    """Samples (rows) and the tokens each holds, prompt and response, and where the numbers come from."""

    samples: int
    tokens_per_sample: float
    source: str

    @property
    def tokens(self) -> int:
        return round(self.samples * self.tokens_per_sample)


def prompt_tokens(prompt: Prompt) -> float:
    """A prompt's expected tokens: its characters / CHARS_PER_TOKEN plus the chat template's per message."""
    messages = prompt.messages
    return sum(len(m.get("content") or "") for m in messages) / CHARS_PER_TOKEN + MESSAGE_OVERHEAD_TOKENS * len(
        messages
    )


def expected_tokens(prompts: list[Prompt], responses_per_prompt: int, max_tokens: int) -> TokenEstimate:
    """The rows sampling makes of `prompts` and their expected tokens (see the module docstring)."""
    samples = len(prompts) * responses_per_prompt
    if not samples:
        return TokenEstimate(0, 0.0, "no prompts")
    response = min(max_tokens, TYPICAL_RESPONSE_TOKENS)
    mean_prompt = sum(prompt_tokens(p) for p in prompts) / len(prompts)
    source = (
        f"expected: {mean_prompt:.0f} prompt tokens (characters / {CHARS_PER_TOKEN}) + {response:,} response "
        f"tokens (sampling.max_tokens {max_tokens:,}, at most {TYPICAL_RESPONSE_TOKENS:,})"
    )
    return TokenEstimate(samples, mean_prompt + response, source)


def share(estimate: TokenEstimate, samples: int, source: str) -> TokenEstimate:
    """The same tokens a sample for `samples` of the rows (the training rows, a held-out share)."""
    return TokenEstimate(samples, estimate.tokens_per_sample, source)


def hidden_state_bytes(tokens: int, hidden_size: int, dtype: str) -> int:
    """Disk the hidden states of `tokens` take at the storage dtype (`extraction.dtype`: bf16 or fp8)."""
    return int(tokens * bytes_per_token(hidden_size, dtype))


def online_buffer_bytes(in_flight: int, prefetch: int, tokens_per_sample: float, hidden_size: int, dtype: str) -> int:
    """Online training's hidden states at any one time: the engine's files of the `in_flight` requests (on
    disk until read) and the `prefetch` samples waiting in memory, at the storage dtype."""
    return int((in_flight + prefetch) * tokens_per_sample * bytes_per_token(hidden_size, dtype))


@dataclass(frozen=True)
class RankMemory:
    """One engine rank's GPU memory: vLLM's pool (`usable`), the weights' share of it, the KV cache the rest."""

    usable: float
    weights: float
    kv_bytes_per_token: float

    @property
    def kv_cache(self) -> float:
        return self.usable - self.weights

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_cache / self.kv_bytes_per_token)) if self.kv_bytes_per_token else 0

    def fits(self, max_model_len: int) -> bool:
        """Whether one `max_model_len` sequence fits the KV cache left (vLLM refuses to start otherwise)."""
        return self.kv_tokens >= max_model_len


def rank_memory(size: ModelSize, facts: DeviceFacts, server: ServerConfig) -> RankMemory | None:
    """GPU memory of each rank of a resolved `server` on `facts`; None on a CPU host."""
    if not facts.cuda:
        return None
    width = server.tensor_parallel_size
    return RankMemory(
        usable=server.gpu_memory_utilization * facts.gpu_memory_bytes,
        weights=size.weight_bytes / width,
        kv_bytes_per_token=size.kv_bytes_per_token_per_rank(width),
    )


def training_processes(training: TrainingConfig, facts: DeviceFacts) -> int:
    """`training.processes` on `facts`: auto is one per GPU for a CUDA device (auto or cuda), else 1."""
    if training.processes != "auto":
        return int(training.processes)
    per_gpu = training.device == "cuda" or (training.device == "auto" and facts.cuda)
    return max(1, facts.gpu_count) if per_gpu else 1


@dataclass(frozen=True)
class TrainingSteps:
    samples: int
    steps_per_epoch: int
    total: int
    epochs: str  # how the total came about: `4 epochs`, `up to 4 epochs (auto)`, `max_steps`


def training_steps(trained: int, training: TrainingConfig, processes: int) -> TrainingSteps:
    """Steps of training on `trained` samples (those left after `training.holdout_fraction` is kept for
    validation): the run's `Schedule`, batches of batch_size per process, every process the same count."""
    per_epoch = math.ceil(trained / (training.batch_size * processes)) if trained else 0
    epochs = training.max_epochs if training.epochs == "auto" else training.epochs
    if training.max_steps:
        return TrainingSteps(trained, per_epoch, training.max_steps, "training.max_steps")
    label = f"up to {epochs:g} epochs (auto)" if training.epochs == "auto" else f"{epochs:g} epoch(s)"
    return TrainingSteps(trained, per_epoch, math.ceil(epochs * per_epoch), label)
