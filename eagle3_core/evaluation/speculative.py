"""Measurement (a): greedy chain speculative decoding with the target in transformers and the exported
draft (`propose_chain`), the reference the vLLM measurement is compared with.

One step: the draft proposes k tokens after the last emitted token; the target verifies all of them in
one forward pass of k+1 tokens; the longest prefix that equals the target's own greedy choices is
accepted and the target's choice after it (the bonus token) is emitted too. Every emitted token is thus
the target's greedy choice, so the output equals plain greedy decoding (exactly in fp32; in bf16 a
k+1-token forward can round differently from one-token steps).

The draft reads the target's states at `draft.config.aux_layer_ids` (vLLM convention: id i is
`output_hidden_states[i]`) for every verified position, taken from the same verification pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_core.draft.model import DraftKVCache, Eagle3Draft
from eagle3_core.evaluation.departures import judge_token_difference
from eagle3_core.evaluation.prompts import EvalPrompt
from eagle3_core.evaluation.segments import merge_segments, segmenter, segments_from_json, segments_json
from eagle3_core.evaluation.stats import AcceptanceStats
from eagle3_core.sampling.chat_tokens import template_messages


@dataclass
class StepTimer:
    """Seconds spent in the draft and in the target (synchronised on CUDA so GPU time is counted)."""

    device: torch.device
    seconds: dict[str, float] = field(default_factory=lambda: {"draft": 0.0, "target": 0.0})

    @contextmanager
    def measure(self, who: str) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[who] += time.perf_counter() - start


@dataclass
class DecodeResult:
    """One prompt's speculative decoding: the generated target ids and where the time went."""

    tokens: list[int]
    stats: AcceptanceStats
    timer: StepTimer
    segments: dict[str, AcceptanceStats] = field(default_factory=dict)  # the steps by `segments.SEGMENTS`


@contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Run the block with `count` intra-op threads (None: unchanged), restoring the previous count."""
    previous = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_target(target_dir: Path | str, dtype: str, device: torch.device):
    """The target as a transformers causal LM in eval mode (a full weight load: the caller records it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every id that ends a completion: the generation config's (an int or a list) and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def render_prompt(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the chat prompt as vLLM's chat endpoint builds them: the messages and tools as vLLM hands
    them to the template, rendered as text with the generation prompt, tokenised without adding special
    tokens again."""
    text = tokenizer.apply_chat_template(
        template_messages(messages), tools=tools or None, add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def target_forward(model, input_ids: list[int], cache, layer_ids: list[int], last_only: bool = False):
    """Run `input_ids` after what `cache` holds -> (greedy next ids [T] (or [1]), aux [T, 3, H], cache)."""
    ids = torch.tensor([input_ids], device=model.device)  # [1, T]
    out = model(
        input_ids=ids,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
        logits_to_keep=1 if last_only else 0,
    )
    greedy = out.logits[0].argmax(-1)  # [T] or [1]
    aux = torch.stack([out.hidden_states[i][0] for i in layer_ids], dim=1)  # [T, 3, H]
    return greedy, aux, out.past_key_values


def truncate_cache(cache, length: int) -> None:
    """Drop the entries past `length` (rejected draft tokens) from a transformers cache."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def accepted_prefix(proposal: list[int], greedy: list[int]) -> int:
    """How many leading draft tokens equal the target's greedy choices at the same positions."""
    count = 0
    while count < len(proposal) and proposal[count] == greedy[count]:
        count += 1
    return count


@torch.no_grad()
def propose_chain(
    draft: Eagle3Draft, cache: DraftKVCache, aux: torch.Tensor, next_ids: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's greedy chain of `num_tokens` tokens after newly verified positions.

    aux [n, 3, Ht]: target states of the n positions verified since the last call (the whole prompt the
    first time); next_ids [n]: the TARGET token following each of them (the last one is the target's newly
    sampled token). The cache keeps the verified entries and drops the chain, so the next call passes only
    the positions verified next. Returns (target ids [num_tokens], draft logits [num_tokens, Vd])."""
    # 1. The verified positions enter the cache, read from the target's states.
    logits, hidden = draft.step(cache, draft.combine_aux(aux), next_ids)  # [n, Vd], [n, H]
    verified = cache.length
    tokens, chain_logits = [], []
    current_logits, current_hidden = logits[-1:], hidden[-1:]  # [1, Vd], [1, H]
    for _ in range(num_tokens):
        # 2. The greedy draft token, as a target id.
        token = draft.draft_to_target(current_logits.argmax(-1))  # [1]
        tokens.append(token)
        chain_logits.append(current_logits)
        # 3. The next step reads the draft's own state, not the target's.
        if len(tokens) < num_tokens:
            current_logits, current_hidden = draft.step(cache, current_hidden, token)
    # 4. Only verified entries stay: the target decides which chain tokens become verified.
    cache.truncate(verified)
    return torch.cat(tokens), torch.cat(chain_logits)


# What makes the k draft tokens of a step: (draft, cache, aux, next_ids, k) -> (target ids [k], logits or None).
Proposer = Callable[
    [Eagle3Draft, DraftKVCache, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]
]


def speculative_generate(
    model,
    draft: Eagle3Draft,
    prompt_ids: list[int],
    max_new_tokens: int,
    k: int,
    eos_ids: set[int],
    propose: Proposer = propose_chain,
    segment: Callable[[list[int]], str] | None = None,
) -> DecodeResult:
    """Greedy chain speculative decoding of one prompt; returns at most `max_new_tokens` target ids,
    ending at the first end-of-sequence token, and the acceptance counts of every verification step (and
    by `segment` of the tokens emitted before it, where given). The draft must be on the target's device;
    `propose` makes its k tokens a step."""
    layer_ids = list(draft.config.aux_layer_ids)
    timer = StepTimer(model.device)
    stats = AcceptanceStats(k)
    segments: dict[str, AcceptanceStats] = {}
    draft_cache = DraftKVCache()
    with timer.measure("target"):
        greedy, aux, cache = target_forward(model, prompt_ids, None, layer_ids, last_only=True)
    tokens = [int(greedy[-1])]
    # Positions verified since the draft last ran, and the token following each: the whole prompt now.
    new_aux, next_ids = aux, [*prompt_ids[1:], tokens[-1]]
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_ids:
        with timer.measure("draft"):
            proposal_ids, _ = propose(draft, draft_cache, new_aux, torch.tensor(next_ids, device=model.device), k)
        proposal = proposal_ids.tolist()
        verified_length = cache.get_seq_length()  # every token but the last emitted one
        with timer.measure("target"):
            greedy_t, aux, cache = target_forward(model, [tokens[-1], *proposal], cache, layer_ids)
        greedy = greedy_t.tolist()  # greedy[i]: the target's choice after tokens[-1], proposal[:i]
        accepted = accepted_prefix(proposal, greedy)
        stats.add_step(accepted)
        if segment is not None:
            segments.setdefault(segment(tokens), AcceptanceStats(k)).add_step(accepted)
        emitted = [*proposal[:accepted], greedy[accepted]]
        truncate_cache(cache, verified_length + 1 + accepted)
        new_aux, next_ids = aux[: accepted + 1], emitted
        tokens.extend(emitted)
    return DecodeResult(cut_at_eos(tokens[:max_new_tokens], eos_ids), stats, timer, segments)


def cut_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """Tokens up to and including the first end-of-sequence token."""
    for index, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: index + 1]
    return tokens


@torch.no_grad()
def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """Plain greedy decoding with transformers' `generate`: the reference speculative output must equal."""
    return greedy_with_gaps(model, prompt_ids, max_new_tokens, eos_ids)[0]


@torch.no_grad()
def greedy_with_gaps(
    model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]
) -> tuple[list[int], list[float]]:
    """Plain greedy decoding, and the gap between the top-2 logits at each emitted token (how close a call
    each greedy choice was: where a speculative output departs, a small gap makes it a near-tie)."""
    from transformers import GenerationConfig

    ids = torch.tensor([prompt_ids], device=model.device)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(eos_ids) or None,  # None: no end-of-sequence token, stop at the length only
        pad_token_id=min(eos_ids, default=0),
        return_dict_in_generate=True,
        output_logits=True,
    )
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = cut_at_eos(out.sequences[0, len(prompt_ids) :].tolist(), eos_ids)
    top2 = [step[0].float().topk(2).values for step in out.logits[: len(tokens)]]  # each [2]
    return tokens, [float(pair[0] - pair[1]) for pair in top2]


def measure_prompt_set(
    model,
    tokenizer,
    draft: Eagle3Draft,
    prompts: list[EvalPrompt],
    k: int,
    max_new_tokens: int,
    lossless: tuple[int, float],
    progress: Callable[[int], None],
) -> dict[str, Any]:
    """Measurement (a) over one prompt set: pooled acceptance, tau for every k' <= k, where the time went,
    and for the first `lossless[0]` prompts whether the output equals plain greedy decoding; a departure
    where plain greedy's top-2 logit gap is below `lossless[1]` is a near-tie (bfloat16 rounds a k+1-token
    verification differently from one-token steps), any other is a defect of the draft's decoding."""
    checks, bound = lossless
    eos = eos_token_ids(model, tokenizer)
    stats = AcceptanceStats(k)
    segments: dict[str, AcceptanceStats] = {}
    seconds = {"draft": 0.0, "target": 0.0}
    tokens = identical = 0
    differences: list[dict[str, Any]] = []
    for index, prompt in enumerate(prompts):
        prompt_ids = render_prompt(tokenizer, prompt.chat_messages(), prompt.tools())
        result = speculative_generate(
            model, draft, prompt_ids, max_new_tokens, k, eos, segment=segmenter(tokenizer, prompt_ids)
        )
        stats = stats.merge(result.stats)
        segments = merge_segments(segments, result.segments)
        for who, value in result.timer.seconds.items():
            seconds[who] += value
        tokens += len(result.tokens)
        if index < checks:
            plain, gaps = greedy_with_gaps(model, prompt_ids, max_new_tokens, eos)
            identical += result.tokens == plain
            if result.tokens != plain:
                differences.append(judge_token_difference(prompt.id, result.tokens, plain, gaps, bound))
        progress(index + 1)
    summary = timing_summary(stats, seconds, tokens, len(prompts), f"{identical}/{min(checks, len(prompts))}")
    return summary | lossless_verdict(differences) | {"segments": segments_json(segments)}


def lossless_verdict(differences: list[dict[str, Any]]) -> dict[str, Any]:
    """The judged departures from plain greedy, their near-ties counted and their defects named."""
    return {
        "differences": differences,
        "near_ties": sum(d["near_tie"] for d in differences),
        "defects": [d["prompt"] for d in differences if not d["near_tie"]],
    }


def timing_summary(
    stats: AcceptanceStats, seconds: dict[str, float], tokens: int, prompts: int, identical: str
) -> dict[str, Any]:
    total = sum(seconds.values()) or 1.0
    return {
        "prompts": prompts,
        "tokens": tokens,
        "acceptance": stats.to_json(),
        "tau_by_k": stats.tau_by_k(),
        "draft_s": seconds["draft"],
        "target_s": seconds["target"],
        "draft_share": seconds["draft"] / total,
        "target_share": seconds["target"] / total,
        "identical_to_greedy": identical,
    }


def pool_prompt_sets(sets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Measurement (a) over all prompt sets together: counts and seconds added up."""
    results = list(sets.values())
    stats = AcceptanceStats.from_json(results[0]["acceptance"])
    for result in results[1:]:
        stats = stats.merge(AcceptanceStats.from_json(result["acceptance"]))
    seconds = {who: sum(r[f"{who}_s"] for r in results) for who in ("draft", "target")}
    checked = [r["identical_to_greedy"].split("/") for r in results]
    identical = f"{sum(int(a) for a, _ in checked)}/{sum(int(b) for _, b in checked)}"
    pooled = timing_summary(
        stats, seconds, sum(r["tokens"] for r in results), sum(r["prompts"] for r in results), identical
    )
    segments: dict[str, AcceptanceStats] = {}
    for result in results:
        segments = merge_segments(segments, segments_from_json(result.get("segments") or {}))
    differences = lossless_verdict([d for r in results for d in r.get("differences", [])])
    return pooled | differences | {"segments": segments_json(segments)}
