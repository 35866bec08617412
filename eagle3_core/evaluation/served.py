"""Measurement (b) on any served engine: the target served twice, with the exported draft as its speculator
and without, one server at a time; per prompt set a batch-1 pass (acceptance counted by the engine itself,
outputs) and a concurrent pass (throughput), then the outputs with the draft judged against plain greedy
(`departures`) and both throughputs compared. `vllm_measure` and `sglang_measure` give the servers and
their clients; the result has one schema, whichever engine measured (its `engine` says which).

Output tokens/s is measured at batch 1 (one request at a time, where speculative decoding pays off) and at a
small concurrency, on both servers, so the speedup compares like with like. Greedy outputs with the draft
must equal plain greedy; a difference at a near-tie is counted, any other is a defect named by prompt id.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from eagle3_core.config import PipelineConfig
from eagle3_core.evaluation.departures import TokenGap, flip_floor, judge_outputs, with_flip_floor
from eagle3_core.evaluation.keyed_results import load_saved, save
from eagle3_core.evaluation.prompts import EvalPrompt
from eagle3_core.evaluation.stats import AcceptanceStats
from eagle3_core.events import DECISION, RESUME, RunEvents
from eagle3_core.phases import EVALUATION
from eagle3_core.progress import ProgressCallback, ProgressUpdate, ignore_progress
from eagle3_core.serving.lifecycle import EngineServer

PHASE = EVALUATION.name
ENGINE_LABELS = {"vllm": "vLLM", "sglang": "SGLang"}


@dataclass
class RequestRun:
    """One pass of a prompt set through a server: outputs in prompt order and the throughput."""

    outputs: list[str]
    completion_tokens: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


class ServedClient(Protocol):
    """The calls measurement (b) makes to a served target, in one engine's API."""

    def model_id(self) -> str: ...

    def chat(self, model: str, prompt: EvalPrompt, max_tokens: int) -> tuple[str, int]:
        """Greedy completion -> (text, completion tokens)."""
        ...

    def chat_top2(self, model: str, prompt: EvalPrompt, max_tokens: int) -> tuple[str, list[TokenGap]]:
        """Greedy completion with each generated token's bytes and top-2 log-probability gap."""
        ...

    def acceptance_mark(self) -> Any:
        """Where the engine's acceptance counts stand now."""
        ...

    def acceptance_since(self, mark: Any) -> AcceptanceStats:
        """What the engine accepted since `mark`; raises when it counted no drafting (no draft loaded)."""
        ...

    def close(self) -> None: ...


def run_prompts(
    client: ServedClient,
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


def measure_on_server(
    client: ServedClient,
    prompt_sets: dict[str, list[EvalPrompt]],
    max_tokens: int,
    concurrency: int,
    with_draft: bool,
    progress: ProgressCallback,
    reference: dict[str, list[str]] | None = None,
    near_tie_bound: float = 0.0,
    engine: str = "vLLM",
) -> dict[str, dict[str, Any]]:
    """Per prompt set: batch-1 and concurrent passes (tokens, seconds; at `concurrency` 1 the one pass is
    both), the batch-1 outputs, (with a draft) the acceptance the engine counted during the batch-1 pass, and
    (given the draft's outputs as `reference`) the judged `differences` of the batch-1 outputs from them
    (`judge_outputs`). `engine` labels progress."""
    model = client.model_id()
    label = f"{engine} {'with' if with_draft else 'without'} draft"
    results: dict[str, dict[str, Any]] = {}
    for name, prompts in prompt_sets.items():
        before = client.acceptance_mark() if with_draft else None
        single = run_prompts(client, model, prompts, max_tokens, 1, progress, f"{label}, {name}, batch 1")
        result: dict[str, Any] = {"batch1": throughput(single), "outputs": single.outputs}
        if before is not None:
            result["acceptance"] = client.acceptance_since(before).to_json()
        if reference is not None:
            outputs = (reference[name], single.outputs)
            result["differences"] = judge_outputs(client, model, prompts, outputs, max_tokens, near_tie_bound)
        if concurrency > 1:
            stage = f"{label}, {name}, concurrency {concurrency}"
            concurrent = run_prompts(client, model, prompts, max_tokens, concurrency, progress, stage)
            result["concurrent"] = throughput(concurrent)
        else:  # one request in flight is the batch-1 pass: not sent a second time
            result["concurrent"] = result["batch1"]
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
    """Per prompt set and pooled over all sets (`all`); a departure no wider than the largest flip of plain
    greedy on its own, in any set, is a near-tie (`with_flip_floor`)."""
    floor = flip_floor([d for run in without.values() for d in run.get("differences", [])])
    without = {
        name: run | {"differences": with_flip_floor(run["differences"], floor)} if "differences" in run else run
        for name, run in without.items()
    }
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
    if floor is not None:
        sets["all"]["plain_flip_gap"] = floor
    return {"k": AcceptanceStats.from_json(pooled["acceptance"]).k, "sets": sets}


def merged_acceptance(acceptances: list[dict[str, Any]]) -> dict[str, Any]:
    stats = [AcceptanceStats.from_json(a) for a in acceptances]
    total = stats[0]
    for other in stats[1:]:
        total = total.merge(other)
    return total.to_json()


@dataclass(frozen=True)
class Measurement:
    """What measurement (b) measures (the target folder served with the exported draft folder, on the prompt
    sets, as the config says) and where it reports."""

    config: PipelineConfig
    target_dir: Path
    draft_dir: Path
    prompt_sets: dict[str, list[EvalPrompt]]
    events: RunEvents
    progress: ProgressCallback = ignore_progress
    with_draft_file: tuple[Path, str] | None = None  # (file, key): the pass with the draft, kept for a resume


def measure_served(
    measurement: Measurement,
    engine: str,
    serve: Callable[[bool], EngineServer],
    connect: Callable[[EngineServer], ServedClient],
) -> dict[str, Any]:
    """Two server starts of `engine` (`serve(with_draft)`: with, then without the draft), one at a time, each
    stopped before the next starts, whatever fails; the pass with the draft is kept in `with_draft_file`, so a
    run cut while plain greedy is measured starts only that server again. Returns `{"engine", "k", "sets":
    {name or "all": acceptance, throughput, speedups, agreement}}` and records the agreement line."""
    evaluation, label, progress = measurement.config.evaluation, ENGINE_LABELS[engine], measurement.progress
    runs: dict[bool, dict[str, dict[str, Any]]] = {}
    kept = measurement.with_draft_file
    if kept is not None and (saved := load_saved(*kept)) is not None:
        runs[True] = saved
        message = f"measurement (b) in {label}: the pass with the draft was done before, only plain greedy is left"
        measurement.events.record(PHASE, RESUME, message, path=str(kept[0]))
    for with_draft in (True, False):
        if with_draft in runs:
            continue
        with serve(with_draft) as server:
            client = connect(server)
            try:
                reference = None if with_draft else {name: run["outputs"] for name, run in runs[True].items()}
                runs[with_draft] = measure_on_server(
                    client,
                    measurement.prompt_sets,
                    evaluation.max_new_tokens,
                    evaluation.concurrency,
                    with_draft,
                    progress,
                    reference=reference,
                    near_tie_bound=evaluation.near_tie_logit_gap,
                    engine=label,
                )
            finally:
                client.close()
        if with_draft and kept is not None:
            save(kept[0], kept[1], runs[True])
    result = {"engine": engine, **compare_runs(runs[True], runs[False])}
    measurement.events.record(
        PHASE, DECISION, agreement_line(result["sets"]["all"], evaluation.near_tie_logit_gap, label)
    )
    return result


def agreement_line(pooled: dict[str, Any], bound: float, engine: str = "vLLM") -> str:
    """The events.jsonl line that judges (b)'s outputs in `engine` against plain greedy."""
    defects, unrepeatable = pooled["defects"], pooled.get("unrepeatable", [])
    named = f" ({len(unrepeatable)} where plain greedy itself does not repeat: {', '.join(unrepeatable)})"
    flip = pooled.get("plain_flip_gap")
    floor = (
        f", or ≤ {flip:g}, the widest gap plain greedy flipped at by itself in this run," if flip is not None else ""
    )
    return (
        f"measurement (b) in {engine}, outputs with the draft vs plain greedy: "
        f"{pooled['identical_outputs']} identical, "
        f"{pooled['near_ties']} near-ties (plain top-2 logit gap < {bound:g}{floor} where the texts first differ), "
        f"{len(defects)} defects{': ' + ', '.join(defects) if defects else ''}{named if unrepeatable else ''}"
    )
