"""The samples folder on disk: Parquet parts written as rows complete, resume by sample id (a prompt's id,
and its response's index past the first: `table.sample_id`), and the final accounting into a `SampleSet`
manifest.

A re-run keeps the ok rows of earlier runs and samples every other response again (an error may have been
a passing fault). Rows no longer asked for (fewer prompts, `sampling.max_prompts`) stay in their parts and
are listed in the SampleSet's `unasked`, which every reader skips: ok + error + skipped always equals the
prompts times `sampling.responses_per_prompt`, and asking for them again costs nothing. Rows made for another
target or other sampling parameters are never mixed in: the folder's run key (target digest, parameters) is
compared first, and the rows of another key are set aside under `<run_dir>/kept/samples/<key id>/`
(`eagle3_core.kept`), to come back when that key is asked for again; the prompt set and the number of
responses per prompt are not part of it (a response is the same request however many are asked for), so
more responses or prompts cost only the new rows. A prompt edited under the same id is sampled again: its
old rows move to `replaced-*.parquet` beside the parts (kept, read by nothing).

`SampleStore` is sampling's one resume API: `take_key()` (set aside another key's rows, bring back this
key's), `cached()` (the finished set, reused whole), `resume(wanted)` (keep the ok rows, return their ids),
`writer()` (new rows as parts), `finish()` (the manifest), and the read-only `ok_ids()`. A run spread over
hosts has one such folder per host's slice (`eagle3_core.hosts`); `merge_slices` accounts for their parts
in the one SampleSet of `<run_dir>/samples`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagle3_core.artifacts import ArtifactInvalid, SampleSet, TargetModel, record_files
from eagle3_core.config import PipelineConfig
from eagle3_core.events import CACHE_HIT, DECISION, RESUME, RunEvents
from eagle3_core.files import remove_dead_temps, sha256_json, write_text_atomic
from eagle3_core.hosts import check_each_once, every_slice
from eagle3_core.kept import key_id, switch_key
from eagle3_core.phases import SAMPLING, phase_key
from eagle3_core.run_layout import RunLayout
from eagle3_core.sampling.conversations import Turns, answers_several_turns, asked_for
from eagle3_core.sampling.prompts import Prompt, load_prompts
from eagle3_core.sampling.table import read_part, sample_id, write_part

KEY_FILE = "run_key.json"
PART_GLOB = "part-*.parquet"
REPLACED_GLOB = "replaced-*.parquet"
# Fields that left the sampling key (they never changed a row): a stored key that has them still matches.
RETIRED_FIELDS = {"server": ("url",)}


def run_key(config: PipelineConfig, target: TargetModel, prompts: list[Prompt]) -> dict[str, Any]:
    """The fields marked content for sampling (what a row holds; concurrency, timeouts and part size only
    change how rows are made), the target and tokenizer, and the digest of the prompt set; `sampling.turns`
    only where a prompt has an assistant turn before its last (else `last` and `all` make the same rows). The
    serving dtype is the resolved one (`auto` -> float32 or bfloat16 on this host): greedy completions differ
    between dtypes, so rows of another dtype are not mixed in; None for an external server (its own dtype)."""
    key = phase_key(config, SAMPLING)
    if not any(answers_several_turns(p.messages) for p in prompts):
        key["sampling"].pop("turns", None)  # the same rows either way: runs of either setting are one cache
    if config.server.engine != "vllm":
        key["server"]["dtype"] = None
    return {
        **key,
        "target": target.digest,
        "tokenizer": target.tokenizer_digest,
        "prompts": sha256_json([p.id for p in prompts]),
    }


def without_retired(stored: Any) -> Any:
    """A stored key without the fields that have left the key (`RETIRED_FIELDS`)."""
    if not isinstance(stored, dict):
        return stored
    trimmed = dict(stored)
    for section, names in RETIRED_FIELDS.items():
        if isinstance(trimmed.get(section), dict):
            trimmed[section] = {k: v for k, v in trimmed[section].items() if k not in names}
    return trimmed


def responses_per_prompt(key: dict[str, Any]) -> int:
    """`sampling.responses_per_prompt` of a run key (which leaves it out at its default, 1)."""
    return key.get("sampling", {}).get("responses_per_prompt", 1)


def row_key(key: dict[str, Any]) -> dict[str, Any]:
    """The part of the run key that rows already written must share to be kept: not the prompt set, nor
    the number of responses per prompt."""
    rows = {k: v for k, v in key.items() if k != "prompts"}
    if "sampling" in rows:
        rows["sampling"] = {k: v for k, v in rows["sampling"].items() if k != "responses_per_prompt"}
    return rows


def is_legacy_key(stored: dict[str, Any], key: dict[str, Any]) -> bool:
    """Whether `stored` was written before the serving dtype entered the key (no server.dtype) and matches
    `key` otherwise. Such rows are kept, with a DECISION line: their dtype was not recorded."""
    server = stored.get("server")
    if not isinstance(server, dict) or "dtype" in server:
        return False
    return stored == {**key, "server": {k: v for k, v in key["server"].items() if k != "dtype"}}


def key_matches(stored: Any, key: dict[str, Any], events: RunEvents | None = None, phase: str = "") -> bool:
    """`stored` (a key file or manifest config) equals `key`, or is its legacy form (see `is_legacy_key`),
    which is recorded in `events` when given."""
    if stored == key:
        return True
    if not isinstance(stored, dict) or not is_legacy_key(stored, key):
        return False
    if events is not None:
        events.record(
            phase,
            DECISION,
            f"samples written before the serving dtype was part of their key: kept as {key['server']['dtype']}",
            dtype=key["server"]["dtype"],
        )
    return True


class PartWriter:
    """Collects rows and writes every `rows_per_part` of them as the next Parquet part (atomically)."""

    def __init__(self, out_dir: Path, rows_per_part: int):
        self.out_dir = out_dir
        self.rows_per_part = rows_per_part
        self.rows: list[dict[str, Any]] = []
        numbers = [int(p.stem.split("-")[1]) for p in out_dir.glob(PART_GLOB)]
        self.next_number = max(numbers, default=-1) + 1

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.rows_per_part:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            write_part(self.rows, self.out_dir / f"part-{self.next_number:05d}.parquet")
            self.next_number += 1
            self.rows = []


@dataclass
class RowTally:
    """What the manifest needs from the rows: ids (to account for the prompts), counts and error reasons."""

    ids: Counter[str] = field(default_factory=Counter)
    status: Counter[str] = field(default_factory=Counter)
    errors: dict[str, str] = field(default_factory=dict)
    tokens: int = 0
    loss_tokens: int = 0
    unasked: set[str] = field(default_factory=set)


def tally_parts(parts: list[Path], wanted: set[str]) -> RowTally:
    """Tally the rows of `parts` whose ids are `wanted` (the others are `unasked`), one part in memory at a
    time (not every row: the client's memory stays flat however many prompts there are)."""
    tally = RowTally()
    for part in parts:
        for row in read_part(part):
            if row["id"] not in wanted:
                tally.unasked.add(row["id"])
                continue
            tally.ids[row["id"]] += 1
            tally.status[row["status"]] += 1
            if row["status"] == "error":
                tally.errors[row["id"]] = row["error"]
            if row["status"] == "ok":
                tally.tokens += len(row["input_ids"])
                tally.loss_tokens += sum(row["loss_mask"])
    return tally


def stored_messages(parts: list[Path], ids: set[str]) -> dict[str, Any]:
    """Sample id -> the messages its row was sampled for, over the rows of `ids` in `parts`."""
    found: dict[str, Any] = {}
    for part in parts:
        table = pq.read_table(part, columns=["id", "messages"]).to_pydict()
        for sid, messages in zip(table["id"], table["messages"], strict=True):
            if sid in ids:
                found[sid] = json.loads(messages)
    return found


def edited_ids(parts: list[Path], prompts: list[Prompt], responses: int, turns: Turns) -> set[str]:
    """Sample ids whose row in `parts` was sampled for other messages than the prompt now under that id asks
    for (`asked_for`: a row stores the history its last turn was asked with, not the prompt as given)."""
    wanted = {sample_id(p.id, r): asked_for(p.messages, turns) for p in prompts for r in range(responses)}
    stored = stored_messages(parts, set(wanted))
    return {sid for sid, messages in stored.items() if asked_for(messages, turns) != wanted[sid]}


class SampleStore:
    """The samples folder `out_dir` of one run key (`run_key`), as the sampling phase resumes it; `phase`
    names its lines in events.jsonl; `kept_root`: where rows of other keys are kept (`RunLayout.kept`)."""

    def __init__(
        self,
        out_dir: Path,
        key: dict[str, Any],
        events: RunEvents,
        phase: str = "sampling",
        kept_root: Path | None = None,
    ):
        self.out_dir, self.key, self.events, self.phase = out_dir, key, events, phase
        self.kept_root = kept_root or out_dir.parent / "kept" / out_dir.name
        self.responses = responses_per_prompt(key)
        self.turns: Turns = key.get("sampling", {}).get("turns", "last")  # keyed only where it changes rows

    @classmethod
    def of_run(
        cls, config: PipelineConfig, target: TargetModel, prompts: list[Prompt], events: RunEvents
    ) -> SampleStore:
        """The store of `<run_dir>/samples` for these settings, target and prompts."""
        layout = RunLayout.of(config)
        key = run_key(config, target, prompts)
        return cls(layout.samples, key, events, kept_root=layout.kept(layout.samples))

    def stored_key(self) -> Any:
        """The folder's run key file, None where it has none (or it is unreadable)."""
        try:
            return json.loads((self.out_dir / KEY_FILE).read_text())
        except (OSError, ValueError):
            return None

    def take_key(self) -> None:
        """Make the folder this key's: rows of another key are set aside under `kept_root` (one DECISION line
        naming the fields that changed), rows of this key kept there come back. Files only move."""
        stored = self.stored_key()
        mine = row_key(self.key)
        if stored is not None and key_matches(stored, mine, self.events, self.phase):
            stored = mine  # a legacy form of this key: the same rows
        for line in switch_key(self.out_dir, self.kept_root, KEY_FILE, without_retired(stored), mine, key_id, "sample"):
            self.events.record(self.phase, DECISION, line)

    def cached(self, prompts: list[Prompt] | None = None) -> SampleSet | None:
        """The finished SampleSet of the same key with no error rows, if its files are intact (and, given
        `prompts`, none of them was edited since it was sampled)."""
        out_dir, phase = self.out_dir, self.phase
        path = out_dir / f"{SampleSet.kind}.json"
        if not path.exists():
            return None
        try:
            sample_set = SampleSet.load(path)
            sample_set.validate()
        except (ArtifactInvalid, ValueError, OSError) as exc:
            self.events.record(phase, DECISION, f"sample set at {out_dir} not reusable, resuming: {exc}")
            return None
        if sample_set.error or not key_matches(sample_set.config, self.key, self.events, phase):
            return None
        parts = [sample_set.path_of(record.path) for record in sample_set.files]
        if prompts is not None and (edited := edited_ids(parts, prompts, self.responses, self.turns)):
            self.events.record(phase, DECISION, f"{len(edited)} prompts edited under the same id: sampling them again")
            return None
        self.events.record(phase, CACHE_HIT, f"{sample_set.ok} samples at {out_dir} reused", digest=sample_set.digest)
        return sample_set

    def sample_ids(self, prompts: list[Prompt]) -> list[str]:
        """The ids of the rows `prompts` make: each prompt's responses in turn."""
        return [sample_id(p.id, r) for p in prompts for r in range(self.responses)]

    def folder_of_key(self) -> Path | None:
        """Where this key's rows are: the folder, or their kept folder before `take_key`; None if nowhere."""
        mine = row_key(self.key)
        key_path = self.out_dir / KEY_FILE
        if key_path.exists() and key_matches(json.loads(key_path.read_text()), mine):
            return self.out_dir
        kept = self.kept_root / key_id(mine)
        return kept if kept.is_dir() else None

    def ok_ids(self, prompts: list[Prompt] | None = None) -> set[str]:
        """Ids of the ok rows already made for this run key, in the folder or kept aside (none when there are
        none), less those of `prompts` edited since; reads only columns, changes nothing."""
        folder = self.folder_of_key()
        if folder is None:
            return set()
        ok: set[str] = set()
        parts = sorted(folder.glob(PART_GLOB))
        for part in parts:
            table = pq.read_table(part, columns=["id", "status"]).to_pydict()
            ok.update(i for i, status in zip(table["id"], table["status"], strict=True) if status == "ok")
        return ok - edited_ids(parts, prompts, self.responses, self.turns) if prompts is not None else ok

    def resume(self, wanted: set[str], prompts: list[Prompt] | None = None) -> set[str]:
        """Keep every ok row (once) in the parts, rewriting parts atomically, and return the ids of those
        `wanted`. Error and skipped rows are dropped (asked again); rows of `prompts` edited since they were
        sampled move to a `replaced-*.parquet` file. Call `take_key` first."""
        out_dir, phase, events = self.out_dir, self.phase, self.events
        out_dir.mkdir(parents=True, exist_ok=True)
        remove_dead_temps(out_dir)
        parts = sorted(out_dir.glob(PART_GLOB))
        edited = edited_ids(parts, prompts, self.responses, self.turns) if prompts is not None else set()
        write_text_atomic(out_dir / KEY_FILE, json.dumps(row_key(self.key), sort_keys=True))
        (out_dir / f"{SampleSet.kind}.json").unlink(missing_ok=True)
        seen: set[str] = set()
        dropped: Counter[str] = Counter()
        replaced: list[dict[str, Any]] = []
        for part in parts:
            rows = read_part(part)
            keep = []
            for row in rows:
                if row["id"] in edited:
                    replaced.append(row)
                elif row["status"] == "ok" and row["id"] not in seen:
                    keep.append(row)
                    seen.add(row["id"])
                else:
                    dropped[row["status"]] += 1
            if replaced:
                number = len(list(out_dir.glob(REPLACED_GLOB)))
                write_part(replaced, out_dir / f"replaced-{number:05d}.parquet")
                replaced = []
            if not keep:
                part.unlink()
            elif len(keep) < len(rows):
                write_part(keep, part)
        kept = seen & wanted
        if parts:
            events.record(
                phase,
                RESUME,
                f"resuming: {len(kept)} ok rows kept, {len(wanted) - len(kept)} rows to sample"
                + (f", {len(seen - wanted)} rows not asked for kept" if seen - wanted else "")
                + (f", {len(edited)} rows of edited prompts set aside" if edited else ""),
                kept=len(kept),
                unasked=len(seen - wanted),
                dropped=dict(dropped),
            )
        return kept

    def writer(self, rows_per_part: int) -> PartWriter:
        """Where new rows go: parts numbered after those already in the folder."""
        return PartWriter(self.out_dir, rows_per_part)

    def finish(self, target: TargetModel, prompts: list[Prompt], parts: list[Path] | None = None) -> SampleSet:
        """Count the rows of `prompts` in `parts` (default: the folder's own; other rows are `unasked`), check
        that each response of each prompt has exactly one (`SlicesMismatch` naming the ids otherwise), and
        save the manifest."""
        out_dir, key = self.out_dir, self.key
        parts = sorted(out_dir.glob(PART_GLOB)) if parts is None else parts
        wanted = self.sample_ids(prompts)
        tally = tally_parts(parts, set(wanted))
        check_each_once(wanted, tally.ids.elements(), f"samples at {out_dir}")
        status = tally.status
        sample_set = SampleSet(
            root=str(out_dir),
            files=record_files(out_dir, parts),
            config=key,
            upstream={"target": target.digest},
            prompts=len(prompts),
            responses_per_prompt=self.responses,
            ok=status["ok"],
            error=status["error"],
            skipped=status["skipped"],
            tokens=tally.tokens,
            loss_tokens=tally.loss_tokens,
            errors=tally.errors,
            target_digest=target.digest,
            tokenizer_digest=target.tokenizer_digest,
            unasked=sorted(tally.unasked),
        )
        sample_set.save()
        return sample_set


def merge_slices(config: PipelineConfig, target: TargetModel, events: RunEvents) -> SampleSet:
    """The one SampleSet of a run sampled by `orchestration.hosts` hosts: every host's finished slice (of
    these settings), its parts recorded under `<run_dir>/samples`; each response of each prompt exactly once."""
    prompts = load_prompts(config.sampling.prompt_files, config.sampling.max_prompts)
    store = SampleStore.of_run(config, target, prompts, events)
    parts: list[Path] = []
    for part in every_slice(config.orchestration.hosts):
        folder = part.folder(store.out_dir)
        mine = [p for p in prompts if part.takes(p.id)]
        sliced = SampleSet.load_valid(folder)
        if sliced is None or not key_matches(sliced.config, run_key(config, target, mine)):
            raise ArtifactInvalid(f"{folder}: host {part.host} of {part.hosts} left no finished sample set")
        parts += [sliced.path_of(record.path) for record in sliced.files]
    return store.finish(target, prompts, parts)
