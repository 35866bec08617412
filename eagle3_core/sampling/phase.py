"""Phase 1, sample: ask the target for its own answers to the prompts, the data a draft learns to predict.

Requests go to an OpenAI-compatible server (a vLLM server started here, one handed in, or an external
URL) with bounded concurrency. Connection errors and 5xx are retried with backoff; a 4xx is the request's
own fault and becomes an error row at once; a server that stays unreachable aborts the run. A started
engine that dies aborts it at once, before any retry is spent and without an error row for any prompt in
flight (those prompts are not the cause, and an error row would count as done on resume): the phase fails
with `SamplingAborted` (an `EngineDied`, transient) naming how the engine ended and its log's last lines.
Rows are written as Parquet parts as they complete, so a crash loses at most one part; a re-run keeps the
ok rows and samples only the rest (errors are retried). Every response (`sampling.responses_per_prompt` of
each prompt, one request each) ends as exactly one row: ok, error (with its reason) or skipped (too long for
the model). A request's seed is `seed` + the prompt's index + RESPONSE_SEED_STRIDE * the response's index:
the same in every run, whatever else is sampled, so a re-run resumes per response. Separate requests rather
than OpenAI's `n` (vLLM 0.32 seeds its n children `seed + child index`, the seeds of the next prompts) keep
seeds apart and let a response that failed be sampled again alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import httpx

from eagle3_core.artifacts import SampleSet, TargetModel
from eagle3_core.config import PipelineConfig, SamplingConfig
from eagle3_core.events import DECISION, RunEvents
from eagle3_core.files import sha256_json
from eagle3_core.hosts import host_slice, in_slice
from eagle3_core.phases import SAMPLING
from eagle3_core.progress import ProgressCallback, ProgressUpdate, RateMeter, ignore_progress
from eagle3_core.sampling.chat_tokens import ChatTokenizer, Tools, split_reasoning
from eagle3_core.sampling.conversations import TurnLog, TurnResult, replay, turns_decision
from eagle3_core.sampling.preflight import preflight_sampling
from eagle3_core.sampling.prompt_formats import Message
from eagle3_core.sampling.prompts import Prompt, load_prompts
from eagle3_core.sampling.store import PartWriter, SampleStore, row_key
from eagle3_core.sampling.table import sample_id
from eagle3_core.serving.engine import (
    ENGINE_EXIT_WAIT_S,
    EngineDied,
    EngineExit,
    ExternalServer,
    VllmServer,
    open_server,
    requests_in_flight,
)
from eagle3_core.serving.shared import CONTEXT_MARGIN, SharedServer, conversation_tokens, running_server, starts_engine

PHASE = SAMPLING.name
RESPONSE_SEED_STRIDE = 2**32  # seeds of response r > 0 lie above those of the first responses of 2**32 prompts
TURN_SEED_STRIDE = 2**48  # turn t of a conversation: above every response's seed of its first turn


class SamplingAborted(EngineDied):
    """The server died or stopped answering; rows already completed are written, a re-run resumes after them."""


class RequestFailed(Exception):
    """A request that failed for good; `unreachable` means the server itself is gone, `rejected` that it
    answered with a 4xx (the request's own fault)."""

    def __init__(self, reason: str, unreachable: bool = False, rejected: bool = False):
        super().__init__(reason)
        self.unreachable = unreachable
        self.rejected = rejected


@dataclass(frozen=True)
class Work:
    """One request to make: response `response` of the prompt at `index` among every prompt."""

    index: int
    prompt: Prompt
    response: int

    @property
    def sample_id(self) -> str:
        return sample_id(self.prompt.id, self.response)


def response_seed(base: int, index: int, response: int) -> int:
    """The request seed of response `response` of the prompt at `index`; `base + index` for the first."""
    return base + index + RESPONSE_SEED_STRIDE * response


def pending_work(every_prompt: list[Prompt], todo: set[str], responses: int) -> list[Work]:
    """The requests whose sample ids are in `todo`, in prompt order (a prompt's responses together); a
    prompt's index is its place among every prompt, whichever host samples it."""
    work = (Work(i, p, r) for i, p in enumerate(every_prompt) for r in range(responses))
    return [w for w in work if w.sample_id in todo]


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def post_with_retry(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    retries: int,
    backoff_s: float,
    engine_exit: EngineExit,
) -> dict[str, Any]:
    """POST and return the JSON answer. Connection errors, timeouts and 5xx are retried `retries` times
    with doubling delays, unless `engine_exit` reports the engine dead (then `SamplingAborted` at once);
    a 4xx is raised at once (sending it again would fail again)."""
    reason, unreachable = "", False
    for attempt in range(retries + 1):
        if attempt:
            if report := engine_exit(0):
                raise SamplingAborted(report)
            await asyncio.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            response = await client.post(url, json=body)
        except httpx.TransportError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            unreachable = isinstance(exc, httpx.ConnectError | httpx.RemoteProtocolError)
            continue
        if response.status_code >= 500:
            reason, unreachable = f"HTTP {response.status_code}: {response.text[:500]}", False
            continue
        if response.status_code >= 400:
            raise RequestFailed(f"HTTP {response.status_code}: {response.text[:500]}", rejected=True)
        return response.json()
    raise RequestFailed(f"{reason} (after {retries} retries)", unreachable=unreachable)


def request_body(
    model: str,
    prompt: Prompt,
    config: SamplingConfig,
    seed: int,
    max_tokens: int,
    history: list[Message] | None = None,
    parses_tools: bool = False,
) -> dict[str, Any]:
    """The chat request for `history` (default: the prompt's messages). The prompt's tools go with it; an
    engine without a tool-call parser gets tool_choice none (vLLM refuses `auto` there), so the target's calls
    stay in its text."""
    body = {
        "model": model,
        "messages": prompt.messages if history is None else history,
        "max_tokens": max_tokens,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "seed": seed,
    }
    if prompt.tools:
        body["tools"] = prompt.tools
        if not parses_tools:
            body["tool_choice"] = "none"
    return body


def parse_completion(answer: dict[str, Any]) -> dict[str, Any]:
    """The row fields of a chat completion. Reasoning comes from the server's reasoning parser
    (`reasoning_content`, or `reasoning` in newer vLLM), else from `<think>` tags in the content; tool calls
    as the server's tool-call parser returned them."""
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning is None:
        reasoning, content = split_reasoning(content)
    usage = answer.get("usage") or {}
    return {
        "reasoning": reasoning,
        "response": content,
        "tool_calls": list(message.get("tool_calls") or []),
        "finish_reason": choice.get("finish_reason") or "",
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
    }


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The name the server serves the target under (first entry of /v1/models)."""
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


class Sampler:
    """Turns prompts into rows against one server: answers each conversation's turns (`sampling.turns`,
    `conversations.replay`) with bounded concurrency, skips a conversation whose first turn is too long for the
    model, and renders the answers into the row's token view."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        config: SamplingConfig,
        tokens: ChatTokenizer,
        max_model_len: int,
        engine_exit: EngineExit,
        turn_log: TurnLog | None = None,
        parses_tools: bool = False,
    ):
        self.base_url = base_url
        self.api_key = api_key
        self.config = config
        self.tokens = tokens
        self.max_model_len = max_model_len
        self.engine_exit = engine_exit
        self.turn_log = turn_log
        self.turns_done = turn_log.load() if turn_log else {}
        self.parses_tools = parses_tools
        self.rewritten = 0  # conversations whose chat template rewrote earlier turns (`conversation_view`)

    def skip_reason(self, history: list[Message], tools: Tools = None) -> tuple[str | None, int]:
        """(reason to skip or None, tokens left for the completion)."""
        length = len(self.tokens.prompt_ids(history, tools))
        room = self.max_model_len - length
        if room < 1:
            return f"prompt has {length} tokens, over the {self.max_model_len} a conversation may hold", 0
        return None, min(self.config.max_tokens, room)

    async def ask(
        self, client: httpx.AsyncClient, model: str, work: Work, history: list[Message], turn: int
    ) -> TurnResult:
        """The target's answer to one turn of `work`'s conversation."""
        reason, max_tokens = self.skip_reason(history, work.prompt.tools)
        if reason:
            return TurnResult(skip=reason)
        seed = response_seed(self.config.seed, work.index, work.response) + TURN_SEED_STRIDE * turn
        body = request_body(model, work.prompt, self.config, seed, max_tokens, history, self.parses_tools)
        url = f"{self.base_url}/v1/chat/completions"
        try:
            answer = await post_with_retry(
                client, url, body, self.config.max_retries, self.config.retry_backoff_s, self.engine_exit
            )
            return TurnResult(fields=parse_completion(answer))
        except RequestFailed as exc:
            await self.abort_if_server_gone(exc)
            return TurnResult(error=str(exc))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            return TurnResult(error=f"malformed answer: {type(exc).__name__}: {exc}")

    async def sample_one(self, client: httpx.AsyncClient, model: str, work: Work) -> dict[str, Any]:
        prompt = work.prompt
        row: dict[str, Any] = {
            "id": work.sample_id,
            "prompt_id": prompt.id,
            "response_index": work.response,
            "messages": prompt.messages,
            "tools": prompt.tools,
        }

        def record(turn: int, fields: dict[str, Any]) -> None:
            if self.turn_log is not None and self.config.turns == "all":
                self.turn_log.record(work.sample_id, turn, fields)

        done = self.turns_done.get(work.sample_id, [])
        result = await replay(
            prompt.messages, self.config.turns, done, lambda h, t: self.ask(client, model, work, h, t), record
        )
        if result.skip is not None or result.error is not None:
            status = "skipped" if result.error is None else "error"
            return {**row, "status": status, "error": result.error or result.skip}
        view = self.tokens.conversation_view(result.turns, prompt.tools)
        self.rewritten += view.trained_turns < len(result.turns)
        history = result.turns[-1][0]
        return {
            **row,
            **result.fields,
            "messages": history,
            "turns": len(result.turns),
            "status": "ok",
            "input_ids": view.input_ids,
            "loss_mask": view.loss_mask,
        }

    async def abort_if_server_gone(self, failure: RequestFailed) -> None:
        """Raise `SamplingAborted` when a request failed for good because the engine died (waiting a moment
        for a dying engine to exit) or the server is unreachable; a 4xx is the request's own fault."""
        if failure.rejected:
            return
        if report := await asyncio.to_thread(self.engine_exit, ENGINE_EXIT_WAIT_S):
            raise SamplingAborted(report) from None
        if failure.unreachable:
            raise SamplingAborted(f"server {self.base_url} unreachable: {failure}") from None

    async def run(self, work: list[Work], on_row: Callable[[dict[str, Any]], None]) -> None:
        """Sample `work` with `config.concurrency` requests in flight; `on_row` gets each row as it
        completes. The first SamplingAborted cancels the rest."""
        queue: asyncio.Queue[Work] = asyncio.Queue()
        for item in work:
            queue.put_nowait(item)
        limits = httpx.Limits(max_connections=self.config.concurrency)
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=30)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers(self.api_key)) as client:
            model = await served_model(client, self.base_url)

            async def worker() -> None:
                while not queue.empty():
                    on_row(await self.sample_one(client, model, queue.get_nowait()))

            tasks = [asyncio.create_task(worker()) for _ in range(min(self.config.concurrency, len(work)))]
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)


class RowProgress:
    """Counts rows as they complete and reports requests done/total, errors and tokens/s."""

    def __init__(self, progress: ProgressCallback, done: int, total: int):
        self.progress = progress
        self.done = done
        self.total = total
        self.errors = 0
        self.tokens = 0
        self.meter = RateMeter()

    def __call__(self, row: dict[str, Any]) -> None:
        self.done += 1
        self.errors += row["status"] == "error"
        self.tokens += row.get("completion_tokens", 0)
        rate = self.meter.rate(self.tokens)
        self.progress(
            ProgressUpdate(
                phase=PHASE,
                stage="requests",
                done=self.done,
                total=self.total,
                unit="requests",
                rate=rate,
                rate_unit="tok/s",
                message=f"{self.errors} errors",
            )
        )


def sample_prompts(
    config: PipelineConfig,
    target: TargetModel,
    events: RunEvents,
    progress: ProgressCallback = ignore_progress,
    server: VllmServer | ExternalServer | SharedServer | None = None,
) -> SampleSet:
    """Sample every prompt (of this host's slice, `orchestration.host`) `sampling.responses_per_prompt`
    times, resuming from rows already written; see the module docstring. A SharedServer is started only when
    there is something to sample."""
    every_prompt = load_prompts(config.sampling.prompt_files, config.sampling.max_prompts)
    part = host_slice(config)
    prompts = [p for p in every_prompt if in_slice(part, p.id)]
    store = SampleStore.of_run(config, target, prompts, events)
    store.take_key()
    if cached := store.cached(prompts):
        return cached
    wanted = set(store.sample_ids(prompts))
    todo = wanted - store.ok_ids(prompts)
    work = pending_work(every_prompt, todo, config.sampling.responses_per_prompt)
    if not work:
        store.resume(wanted, prompts)
        return store.finish(target, prompts)
    preflight_sampling(config, target, store.out_dir, len(work), starts_engine(server), events)
    writer = store.writer(config.sampling.rows_per_part)
    counts = RowProgress(progress, len(wanted) - len(todo), len(wanted))
    turn_log = TurnLog(store.out_dir, sha256_json(row_key(store.key)))
    started = (
        open_server(config.server, target.root, config.run_dir, events, progress, PHASE, part)
        if server is None
        else nullcontext(running_server(server, PHASE, progress))
    )
    try:
        with started as running:
            # Only now, with the preflight passed and the engine up, is anything in the folder rewritten.
            kept = store.resume(wanted, prompts)
            work = pending_work(every_prompt, wanted - kept, config.sampling.responses_per_prompt)
            sample_with(running, config, target, work, writer, counts, events, turn_log)
    finally:
        writer.flush()
    if not counts.errors:
        turn_log.clear()
    return store.finish(target, prompts)


def sample_with(
    server: VllmServer | ExternalServer,
    config: PipelineConfig,
    target: TargetModel,
    work: list[Work],
    writer: PartWriter,
    counts: RowProgress,
    events: RunEvents,
    turn_log: TurnLog | None = None,
) -> None:
    """Sample `work` on a running server, each row to `writer` and `counts` as it completes; the answers of
    unfinished conversations are resumed from, and recorded in, `turn_log`."""

    def record(row: dict[str, Any]) -> None:
        writer.add(row)
        counts(row)

    in_flight = requests_in_flight(config.server, config.sampling.concurrency)
    held = conversation_tokens(config.server.max_model_len, target.context_tokens)
    if held < config.server.max_model_len:
        events.record(PHASE, DECISION, f"conversations held to {held} tokens, not server.max_model_len "
                      f"{config.server.max_model_len}: the target's context is {target.context_tokens} tokens "
                      f"(max_position_embeddings) and extraction needs {CONTEXT_MARGIN} beyond each",
                      max_model_len=held)  # fmt: skip
    sampler = Sampler(
        server.base_url,
        server.api_key,
        config.sampling.model_copy(update={"concurrency": in_flight}),
        ChatTokenizer(target.root),
        held,
        server.exit_report,
        turn_log,
        bool(config.server.tool_call_parser),
    )
    if config.sampling.turns == "all":
        events.record(PHASE, DECISION, turns_decision(work, sampler.turns_done), turns="all")
    counts.meter = RateMeter()  # tokens/s of sampling alone, not of the engine start before it
    try:
        asyncio.run(sampler.run(work, record))
    except SamplingAborted as exc:
        sampled = len(work) - (counts.total - counts.done)
        events.record(
            PHASE,
            DECISION,
            f"aborted after {sampled} of {len(work)} requests, their rows kept, {len(work) - sampled} left "
            f"for a re-run: {str(exc).splitlines()[0]}",
            sampled=sampled,
            left=len(work) - sampled,
            reason=str(exc),
        )
        raise
    if sampler.rewritten:
        events.record(
            PHASE,
            DECISION,
            f"{sampler.rewritten} conversations: the chat template renders earlier turns differently from how they "
            "were served (e.g. drops their reasoning); their rows train on the answers from that turn on",
            rewritten=sampler.rewritten,
        )
    seconds = time.monotonic() - counts.meter.start
    events.record(
        PHASE,
        DECISION,
        f"sampled {len(work)} requests in {seconds:.0f} s: {counts.errors} errors, "
        f"{counts.meter.rate(counts.tokens):.0f} completion tokens/s",
        prompts=len(work),  # requests, one per response (the name older event logs have)
        errors=counts.errors,
        completion_tokens=counts.tokens,
        seconds=seconds,
    )
