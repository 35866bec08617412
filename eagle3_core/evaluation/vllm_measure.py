"""Measurement (b): acceptance and throughput inside vLLM, the engine the draft will serve in.

The target is served twice in one run: with the exported draft (`--speculative-config` method eagle3, k
tokens) and without. Acceptance comes from vLLM's own `vllm:spec_decode_*` counters on `/metrics`, read
before and after each prompt set (the difference is that set's share), so the numbers are the engine's,
not ours. Output tokens/s is measured at batch 1 (one request at a time, where speculative decoding pays
off) and at a small concurrency, on both servers, so the speedup compares like with like.

Greedy outputs with the draft must equal plain greedy. On a GPU the verification of k+1 tokens and a one-token
decode run differently shaped kernels, so a near-tie can flip: where two texts first differ, the plain server
is asked again for that prompt with its top-2 log-probabilities, and the difference counts as a near-tie when
the plain run's top-2 gap there (log-softmax differences equal logit differences) is below
`evaluation.near_tie_logit_gap`. Where that repeat itself departs from the first plain run, plain greedy
does not repeat on this engine (batch-variant kernels: on the H200 the W4A16 MoE target in bf16 did so on all
8 prompts), so there is no fixed reference: those prompts are counted and named apart, as `unrepeatable`.
Any other difference is a defect, named by prompt id.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from eagle3_core.config import PipelineConfig
from eagle3_core.evaluation.prompts import EvalPrompt
from eagle3_core.evaluation.stats import AcceptanceStats
from eagle3_core.events import DECISION, RunEvents
from eagle3_core.phases import EVALUATION
from eagle3_core.progress import ProgressCallback, ProgressUpdate, ignore_progress
from eagle3_core.serving.engine import attention_backend

PHASE = EVALUATION.name
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SAMPLE_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
LABEL = re.compile(r'(?P<key>\w+)="(?P<value>(?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line of Prometheus' text format; comments skipped."""
    samples = []
    for line in text.splitlines():
        match = SAMPLE_LINE.match(line.strip())
        if not match or line.startswith("#"):
            continue
        labels = {m["key"]: m["value"] for m in LABEL.finditer(match["labels"] or "")}
        samples.append((match["name"], labels, float(match["value"])))
    return samples


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative-decoding counters, summed over engines (data-parallel ranks)."""

    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_position: tuple[float, ...]

    def minus(self, before: SpecCounters) -> SpecCounters:
        """Counts between two scrapes; positions missing from `before` count from zero."""
        earlier = list(before.accepted_per_position)
        earlier += [0.0] * (len(self.accepted_per_position) - len(earlier))
        return SpecCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            tuple(a - b for a, b in zip(self.accepted_per_position, earlier, strict=True)),
        )

    def to_stats(self) -> AcceptanceStats:
        """As `AcceptanceStats`; vLLM's per-position counters must add up to its accepted total."""
        if round(sum(self.accepted_per_position)) != round(self.accepted):
            raise ValueError(
                f"vLLM per-position accepted counts {self.accepted_per_position} do not add up to {self.accepted}"
            )
        k = len(self.accepted_per_position)
        return AcceptanceStats(k, round(self.drafts), [round(a) for a in self.accepted_per_position])


def spec_counters(metrics_text: str) -> SpecCounters:
    """Read the `vllm:spec_decode_*` counters from a /metrics scrape; a server without a drafter has none
    and raises, naming the metric (a typo'd speculative config otherwise reads as zero acceptance)."""
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for name, labels, value in parse_prometheus(metrics_text):
        if name == ACCEPTED_PER_POS:
            position = int(labels["position"])
            per_position[position] = per_position.get(position, 0.0) + value
        elif name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
            totals[name] = totals.get(name, 0.0) + value
    missing = [n for n in (DRAFTS, DRAFT_TOKENS, ACCEPTED) if n not in totals]
    if missing or not per_position:
        raise ValueError(f"/metrics has no speculative-decoding counters ({missing or ACCEPTED_PER_POS})")
    return SpecCounters(
        totals[DRAFTS],
        totals[DRAFT_TOKENS],
        totals[ACCEPTED],
        tuple(per_position.get(i, 0.0) for i in range(max(per_position) + 1)),
    )


@dataclass
class RequestRun:
    """One pass of a prompt set through a server: outputs in prompt order and the throughput."""

    outputs: list[str]
    completion_tokens: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


class OpenAIClient:
    """The few calls evaluation makes to an OpenAI-compatible server."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def model_id(self) -> str:
        response = self.http.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    def metrics(self) -> str:
        response = self.http.get("/metrics")
        response.raise_for_status()
        return response.text

    def chat(self, model: str, prompt: EvalPrompt, max_tokens: int) -> tuple[str, int]:
        """Greedy chat completion -> (text, completion tokens)."""
        choice, usage = self.complete(model, prompt, max_tokens, {})
        return choice["message"].get("content") or "", int(usage["completion_tokens"])

    def chat_top2(self, model: str, prompt: EvalPrompt, max_tokens: int) -> tuple[str, list[TokenGap]]:
        """Greedy chat completion with each generated token's bytes and top-2 log-probability gap."""
        choice, _ = self.complete(model, prompt, max_tokens, {"logprobs": True, "top_logprobs": 2})
        return choice["message"].get("content") or "", token_gaps(choice["logprobs"]["content"])

    def complete(
        self, model: str, prompt: EvalPrompt, max_tokens: int, extra: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        body = {
            "model": model,
            "messages": prompt.chat_messages(),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "seed": 0,
            **extra,
        }
        response = self.http.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"prompt {prompt.id}: HTTP {response.status_code}: {response.text[:500]}")
        data = response.json()
        return data["choices"][0], data["usage"]


@dataclass(frozen=True)
class TokenGap:
    """One generated token: its UTF-8 bytes and the gap between its top-2 log-probabilities."""

    token: bytes
    gap: float


def token_gaps(content: list[dict[str, Any]]) -> list[TokenGap]:
    """From the OpenAI `logprobs.content` list: each token's bytes (`bytes`, else its text) and top-2 gap
    (infinite when only one alternative came back)."""
    gaps = []
    for entry in content:
        raw = entry.get("bytes")
        token = bytes(raw) if raw is not None else entry["token"].encode()
        top = sorted((alt["logprob"] for alt in entry.get("top_logprobs") or []), reverse=True)
        gaps.append(TokenGap(token, top[0] - top[1] if len(top) > 1 else float("inf")))
    return gaps


def first_difference(a: str, b: str) -> int | None:
    """The first character index where two texts differ (the shorter one's length if one extends the
    other), or None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def tokens_at(tokens: list[TokenGap], text: str, char_index: int) -> list[int]:
    """Indices of the tokens where a text departing from `text` (the tokens' concatenation) at `char_index`
    chose another token: the token holding that character, and the one before when the character starts a
    token (the other text may have taken a longer token there, as " then" for " the"). Empty past the end."""
    offset, start = len(text[:char_index].encode()), 0
    for index, token in enumerate(tokens):
        end = start + len(token.token)
        if end > offset:
            return [index - 1, index] if offset == start and index > 0 else [index]
        start = end
    return []


def judge_difference(
    prompt_id: str, texts: tuple[str, str, str], tokens: list[TokenGap], bound: float
) -> dict[str, Any]:
    """Where the draft's text first departs from plain greedy (`texts`: draft, plain, and a repeat of the
    plain request that returned `tokens`): the plain run's token there (the smaller gap of the two candidates
    at a token boundary, `tokens_at`) and its top-2 gap; a near-tie when the gap is below `bound`. The repeat
    must return the plain text again, else plain greedy itself is not repeatable: a defect."""
    draft_text, plain_text, repeat_text = texts
    char = first_difference(draft_text, plain_text)
    candidates = tokens_at(tokens, plain_text, char) if char is not None else []
    index = min(candidates, key=lambda i: tokens[i].gap, default=None)
    gap = tokens[index].gap if index is not None else None
    repeatable = repeat_text == plain_text
    near_tie = repeatable and gap is not None and gap < bound
    return {"prompt": prompt_id, "char": char, "token": index, "gap": gap, "repeatable": repeatable,
            "near_tie": near_tie}  # fmt: skip


def judge_outputs(
    client: OpenAIClient,
    model: str,
    prompts: list[EvalPrompt],
    outputs: tuple[list[str], list[str]],
    max_tokens: int,
    bound: float,
) -> list[dict[str, Any]]:
    """`judge_difference` for every prompt whose draft output (first) differs from the plain one (second),
    asking the plain server (`client`) again with log-probabilities."""
    judged = []
    for prompt, draft_text, plain_text in zip(prompts, *outputs, strict=True):
        if draft_text != plain_text:
            repeat_text, tokens = client.chat_top2(model, prompt, max_tokens)
            judged.append(judge_difference(prompt.id, (draft_text, plain_text, repeat_text), tokens, bound))
    return judged


def run_prompts(
    client: OpenAIClient,
    model: str,
    prompts: list[EvalPrompt],
    max_tokens: int,
    concurrency: int,
    progress: ProgressCallback,
    stage: str,
) -> RequestRun:
    """Send every prompt with at most `concurrency` in flight; outputs come back in prompt order."""
    start = time.perf_counter()
    done = 0

    def one(prompt: EvalPrompt) -> tuple[str, int]:
        nonlocal done
        result = client.chat(model, prompt, max_tokens)
        done += 1
        progress(ProgressUpdate(phase=PHASE, stage=stage, done=done, total=len(prompts), unit="requests"))
        return result

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    return RequestRun([text for text, _ in results], sum(tokens for _, tokens in results), wall)


def speculative_args(draft_dir: Path, k: int, server_args: list[str]) -> list[str]:
    """vLLM's flags for the draft. An `--attention-backend` the target is given in `server_args` is given to
    the draft too: vLLM otherwise picks the draft's kernel on its own (on an AMX CPU the AMX MLA kernel beside
    a target told to run the reference one), and the two then share no KV-cache layout."""
    config: dict[str, Any] = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}
    backend = attention_backend(server_args)
    if backend is not None:
        config["attention_backend"] = backend
    return ["--speculative-config", json.dumps(config)]


def measure_on_server(
    client: OpenAIClient,
    prompt_sets: dict[str, list[EvalPrompt]],
    max_tokens: int,
    concurrency: int,
    with_draft: bool,
    progress: ProgressCallback,
    reference: dict[str, list[str]] | None = None,
    near_tie_bound: float = 0.0,
) -> dict[str, dict[str, Any]]:
    """Per prompt set: batch-1 and concurrent passes (tokens, seconds), the batch-1 outputs, (with a draft)
    the acceptance vLLM counted during the batch-1 pass, and (given the draft's outputs as `reference`) the
    judged `differences` of the batch-1 outputs from them (`judge_outputs`)."""
    model = client.model_id()
    label = "with draft" if with_draft else "without draft"
    results: dict[str, dict[str, Any]] = {}
    for name, prompts in prompt_sets.items():
        before = spec_counters(client.metrics()) if with_draft else None
        single = run_prompts(client, model, prompts, max_tokens, 1, progress, f"vLLM {label}, {name}, batch 1")
        result: dict[str, Any] = {"batch1": throughput(single), "outputs": single.outputs}
        if before is not None:
            result["acceptance"] = spec_counters(client.metrics()).minus(before).to_stats().to_json()
        if reference is not None:
            outputs = (reference[name], single.outputs)
            result["differences"] = judge_outputs(client, model, prompts, outputs, max_tokens, near_tie_bound)
        stage = f"vLLM {label}, {name}, concurrency {concurrency}"
        result["concurrent"] = throughput(run_prompts(client, model, prompts, max_tokens, concurrency, progress, stage))
        results[name] = result
    return results


def throughput(run: RequestRun) -> dict[str, float]:
    return {"tokens": run.completion_tokens, "wall_s": run.wall_s, "tokens_per_s": run.tokens_per_s}


def pooled_throughput(runs: list[dict[str, float]]) -> dict[str, float]:
    """Tokens and seconds added up over prompt sets (tokens/s of the whole, not a mean of rates)."""
    tokens, wall = sum(r["tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0}


def compare(draft: dict[str, Any], plain: dict[str, Any], outputs: tuple[list[str], list[str]]) -> dict[str, Any]:
    """Acceptance, both throughputs and speedups, and output agreement: identical, near-ties, and the prompt
    ids of the defects (differences not at a near-tie; bf16 outputs may drift after ~100 tokens, so agreement
    is reported, not required)."""
    same = sum(a == b for a, b in zip(*outputs, strict=True))
    differences = plain.get("differences", [])
    result: dict[str, Any] = {
        "acceptance": draft["acceptance"],
        "identical_outputs": f"{same}/{len(outputs[0])}",
        "near_ties": sum(d["near_tie"] for d in differences),
        "unrepeatable": [d["prompt"] for d in differences if not d.get("repeatable", True)],
        "defects": [d["prompt"] for d in differences if d.get("repeatable", True) and not d["near_tie"]],
        "differences": differences,
    }
    for mode in ("batch1", "concurrent"):
        rate_draft, rate_plain = draft[mode]["tokens_per_s"], plain[mode]["tokens_per_s"]
        result[mode] = {"draft": draft[mode], "plain": plain[mode], "speedup": rate_draft / max(rate_plain, 1e-9)}
    return result


def compare_runs(with_draft: dict[str, dict[str, Any]], without: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per prompt set and pooled over all sets (`all`)."""
    sets = {
        name: compare(run, without[name], (run["outputs"], without[name]["outputs"]))
        for name, run in with_draft.items()
    }
    pooled = {
        "acceptance": merged_acceptance([run["acceptance"] for run in with_draft.values()]),
        **{
            label: {mode: pooled_throughput([r[mode] for r in runs.values()]) for mode in ("batch1", "concurrent")}
            for label, runs in (("draft", with_draft), ("plain", without))
        },
    }
    pooled["plain"]["differences"] = [d for run in without.values() for d in run.get("differences", [])]
    outputs = (
        [o for run in with_draft.values() for o in run["outputs"]],
        [o for run in without.values() for o in run["outputs"]],
    )
    sets["all"] = compare(pooled["draft"] | {"acceptance": pooled["acceptance"]}, pooled["plain"], outputs)
    return {"k": AcceptanceStats.from_json(pooled["acceptance"]).k, "sets": sets}


def merged_acceptance(acceptances: list[dict[str, Any]]) -> dict[str, Any]:
    stats = [AcceptanceStats.from_json(a) for a in acceptances]
    total = stats[0]
    for other in stats[1:]:
        total = total.merge(other)
    return total.to_json()


def measure_vllm(
    config: PipelineConfig,
    target_dir: Path,
    draft_dir: Path,
    prompt_sets: dict[str, list[EvalPrompt]],
    events: RunEvents,
    progress: ProgressCallback = ignore_progress,
) -> dict[str, dict[str, Any]]:
    """Measurement (b): two server starts (with, then without the draft), one at a time, each stopped
    before the next starts. Returns `{"k", "sets": {name or "all": acceptance, throughput, speedups}}`."""
    from eagle3_core.serving.engine import VllmServer

    evaluation = config.evaluation
    runs: dict[bool, dict[str, dict[str, Any]]] = {}
    for with_draft in (True, False):
        k = evaluation.num_speculative_tokens
        extra = speculative_args(draft_dir, k, config.server.extra_args) if with_draft else []
        with VllmServer(
            config.server,
            target_dir,
            config.run_dir,
            events,
            progress=progress,
            extra_args=extra,
            phase=PHASE,
        ) as server:
            client = OpenAIClient(server.base_url, server.api_key, config.sampling.request_timeout_s)
            try:
                reference = None if with_draft else {name: run["outputs"] for name, run in runs[True].items()}
                runs[with_draft] = measure_on_server(
                    client,
                    prompt_sets,
                    evaluation.max_new_tokens,
                    evaluation.concurrency,
                    with_draft,
                    progress,
                    reference=reference,
                    near_tie_bound=evaluation.near_tie_logit_gap,
                )
            finally:
                client.close()
    result = compare_runs(runs[True], runs[False])
    events.record(PHASE, DECISION, agreement_line(result["sets"]["all"], evaluation.near_tie_logit_gap))
    return result


def agreement_line(pooled: dict[str, Any], bound: float) -> str:
    """The events.jsonl line that judges (b)'s outputs against plain greedy."""
    defects, unrepeatable = pooled["defects"], pooled.get("unrepeatable", [])
    named = f" ({len(unrepeatable)} where plain greedy itself does not repeat: {', '.join(unrepeatable)})"
    return (
        f"measurement (b) outputs with the draft vs plain greedy: {pooled['identical_outputs']} identical, "
        f"{pooled['near_ties']} near-ties (plain top-2 logit gap < {bound:g} where the texts first differ), "
        f"{len(defects)} defects{': ' + ', '.join(defects) if defects else ''}{named if unrepeatable else ''}"
    )
