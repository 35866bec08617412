"""The numbers of a plan, each a pure function: tokens a run will sample, the disk its hidden states take
(stored, or online's buffer), the GPU memory of each engine rank, and the training steps.

Before sampling, a sample's tokens are expected, not known: its prompt rendered with the target's chat template
and counted by its tokenizer where the target's folder is at hand (else at `CHARS_PER_TOKEN` characters a
token plus `MESSAGE_OVERHEAD_TOKENS` of chat template a message), and a response of `sampling.max_tokens`
capped at `TYPICAL_RESPONSE_TOKENS`: the seeds' 10,000 Kimi-K2.5 reasoning responses came to 21M tokens,
2,100 a sample, at max_tokens 16,384. Once a SampleSet exists, its own token count is used.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_core.config import ServerConfig, TrainingConfig
from eagle3_core.devices import DeviceFacts
from eagle3_core.hidden_states.reader import pack
from eagle3_core.hidden_states.storage import bytes_per_token
from eagle3_core.model_size import ModelSize
from eagle3_core.sampling.chat_tokens import ChatTokenizer
from eagle3_core.sampling.conversations import Turns, turn_positions
from eagle3_core.sampling.prompts import Prompt
from eagle3_core.training.batches import epoch_steps, run_steps

CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 8
TYPICAL_RESPONSE_TOKENS = 2_100
TEMPLATED_PROMPTS = 256  # prompts rendered with the target's chat template to count a prompt's tokens


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


def templated_tokens(prompts: list[Prompt], chat: ChatTokenizer) -> float:
    """A prompt's mean tokens as the server is fed them (the target's own chat template and tokenizer, what
    sampling records), over at most TEMPLATED_PROMPTS prompts spread over the set, plus the tokens the template
    writes around an assistant reply (its end-of-turn markers)."""
    step = max(1, len(prompts) // TEMPLATED_PROMPTS)
    chosen = prompts[::step][:TEMPLATED_PROMPTS]
    around_reply = len(chat.encode(chat.assistant_text(chosen[0].messages, "")))
    return sum(len(chat.prompt_ids(p.messages)) for p in chosen) / len(chosen) + around_reply


def expected_tokens(
    prompts: list[Prompt],
    responses_per_prompt: int,
    max_tokens: int,
    chat: ChatTokenizer | None = None,
    turns: Turns = "last",
) -> TokenEstimate:
    """The rows sampling makes of `prompts` and their expected tokens (see the module docstring); with the
    target's tokenizer at hand (`chat`), the prompts' tokens are counted, not estimated; under
    `sampling.turns: all` a row holds an answer for each of its conversation's assistant turns."""
    samples = len(prompts) * responses_per_prompt
    if not samples:
        return TokenEstimate(0, 0.0, "no prompts")
    response = min(max_tokens, TYPICAL_RESPONSE_TOKENS)
    if chat is not None:
        mean_prompt = templated_tokens(prompts, chat)
        how = "the target's chat template and tokenizer"
    else:
        mean_prompt = sum(prompt_tokens(p) for p in prompts) / len(prompts)
        how = f"characters / {CHARS_PER_TOKEN}"
    answers = sum(len(turn_positions(p.messages, turns)) for p in prompts) / len(prompts)
    each = f" x {answers:.2f} answered turns (sampling.turns all)" if turns == "all" else ""
    source = (
        f"expected: {mean_prompt:.0f} prompt tokens ({how}) + {response:,} response "
        f"tokens (sampling.max_tokens {max_tokens:,}, at most {TYPICAL_RESPONSE_TOKENS:,}){each}"
    )
    return TokenEstimate(samples, mean_prompt + response * answers, source)


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


@dataclass(frozen=True)
class TrainingSteps:
    samples: int
    sequences: int  # packed sequences of at most training.max_length tokens (what a step's batch holds)
    steps_per_epoch: int
    total: int
    epochs: str  # how the total came about: `4 epochs`, `up to 4 epochs (auto)`, `max_steps`


def training_steps(lengths: list[int], training: TrainingConfig, processes: int) -> TrainingSteps:
    """Steps of training on samples of `lengths` tokens (those left after `training.holdout_fraction` is kept
    for validation), counted by training's own rules: its packing (`hidden_states.reader.pack`), its steps an
    epoch and a run (`training.batches.epoch_steps`, `run_steps`)."""
    sequences = len(pack(lengths, training.max_length))
    per_epoch = epoch_steps(sequences, training.batch_size, processes) if sequences else 0
    epochs = training.max_epochs if training.epochs == "auto" else training.epochs
    total = run_steps(per_epoch, training.max_steps, epochs)
    if training.max_steps:
        label = "training.max_steps"
    else:
        label = f"up to {epochs:g} epochs (auto)" if training.epochs == "auto" else f"{epochs:g} epoch(s)"
    return TrainingSteps(len(lengths), sequences, per_epoch, total, label)
