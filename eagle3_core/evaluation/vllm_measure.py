"""Measurement (b): acceptance and throughput inside vLLM, the engine the draft will serve in.

The target is served twice in one run: with the exported draft (`--speculative-config` method eagle3, k
tokens) and without. Acceptance comes from vLLM's own `vllm:spec_decode_*` counters on `/metrics`, read
before and after each prompt set (the difference is that set's share), so the numbers are the engine's,
not ours. Output tokens/s is measured at batch 1 (one request at a time, where speculative decoding pays
off) and at a small concurrency, on both servers, so the speedup compares like with like.
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
from eagle3_core.events import RunEvents
from eagle3_core.phases import EVALUATION
from eagle3_core.progress import ProgressCallback, ProgressUpdate, ignore_progress

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
        body = {
            "model": model,
            "messages": prompt.chat_messages(),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "seed": 0,
        }
        response = self.http.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"prompt {prompt.id}: HTTP {response.status_code}: {response.text[:500]}")
        data = response.json()
        return data["choices"][0]["message"].get("content") or "", int(data["usage"]["completion_tokens"])


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


def speculative_args(draft_dir: Path, k: int) -> list[str]:
    config = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}
    return ["--speculative-config", json.dumps(config)]


def measure_on_server(
    client: OpenAIClient,
    prompt_sets: dict[str, list[EvalPrompt]],
    max_tokens: int,
    concurrency: int,
    with_draft: bool,
    progress: ProgressCallback,
) -> dict[str, dict[str, Any]]:
    """Per prompt set: batch-1 and concurrent passes (tokens, seconds), the batch-1 outputs, and (with a
    draft) the acceptance vLLM counted during the batch-1 pass."""
    model = client.model_id()
    label = "with draft" if with_draft else "without draft"
    results: dict[str, dict[str, Any]] = {}
    for name, prompts in prompt_sets.items():
        before = spec_counters(client.metrics()) if with_draft else None
        single = run_prompts(client, model, prompts, max_tokens, 1, progress, f"vLLM {label}, {name}, batch 1")
        result: dict[str, Any] = {"batch1": throughput(single), "outputs": single.outputs}
        if before is not None:
            result["acceptance"] = spec_counters(client.metrics()).minus(before).to_stats().to_json()
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
    """Acceptance, both throughputs and speedups, and output agreement (bf16 outputs may drift after ~100
    tokens, so agreement is reported, not required)."""
    same = sum(a == b for a, b in zip(*outputs, strict=True))
    result: dict[str, Any] = {"acceptance": draft["acceptance"], "identical_outputs": f"{same}/{len(outputs[0])}"}
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
        extra = speculative_args(draft_dir, evaluation.num_speculative_tokens) if with_draft else []
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
                runs[with_draft] = measure_on_server(
                    client,
                    prompt_sets,
                    evaluation.max_new_tokens,
                    evaluation.concurrency,
                    with_draft,
                    progress,
                )
            finally:
                client.close()
    return compare_runs(runs[True], runs[False])
