"""The samples folder on disk: Parquet parts written as rows complete, resume by sample id (a prompt's id,
and its response's index past the first: `table.sample_id`), and the final accounting into a `SampleSet`
manifest.

A re-run keeps the ok rows of earlier runs and samples every other response again (an error may have been
a passing fault); rows no longer asked for are dropped so that ok + error + skipped always equals the
prompts times `sampling.responses_per_prompt`. Rows made for another target or other sampling parameters
are never mixed in: the folder's run key (target digest, parameters) is compared first; the prompt set and
the number of responses per prompt are not part of it (a response is the same request however many are
asked for), so more responses or prompts cost only the new rows.

`SampleStore` is sampling's one resume API: `cached()` (the finished set, reused whole), `resume(wanted)`
(keep the ok rows, return their ids), `writer()` (new rows as parts), `finish()` (the manifest), and the
read-only `ok_ids()`. A run spread over hosts has one such folder per host's slice (`eagle3_core.hosts`);
`merge_slices` accounts for their parts in the one SampleSet of `<run_dir>/samples`.
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
from eagle3_core.files import sha256_json, write_text_atomic
from eagle3_core.hosts import check_each_once, every_slice
from eagle3_core.phases import SAMPLING, phase_key
from eagle3_core.run_layout import RunLayout
from eagle3_core.sampling.prompts import Prompt, load_prompts
from eagle3_core.sampling.table import read_part, sample_id, write_part

KEY_FILE = "run_key.json"
PART_GLOB = "part-*.parquet"


def run_key(config: PipelineConfig, target: TargetModel, prompts: list[Prompt]) -> dict[str, Any]:
    """The fields marked content for sampling (what a row holds; concurrency, timeouts and part size only
    change how rows are made), the target and tokenizer, and the digest of the prompt set. The serving dtype
    is the resolved one (`auto` -> float32 or bfloat16 on this host): greedy completions differ between
    dtypes, so rows of another dtype are not mixed in; None for an external server (its dtype is its own)."""
    key = phase_key(config, SAMPLING)
    if config.server.engine != "vllm":
        key["server"]["dtype"] = None
    return {
        **key,
        "target": target.digest,
        "tokenizer": target.tokenizer_digest,
        "prompts": sha256_json([p.id for p in prompts]),
    }


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


def tally_parts(parts: list[Path]) -> RowTally:
    """Tally the rows of `parts`, one part in memory at a time (not every row: the client's memory stays
    flat however many prompts there are)."""
    tally = RowTally()
    for part in parts:
        for row in read_part(part):
            tally.ids[row["id"]] += 1
            tally.status[row["status"]] += 1
            if row["status"] == "error":
                tally.errors[row["id"]] = row["error"]
            if row["status"] == "ok":
                tally.tokens += len(row["input_ids"])
                tally.loss_tokens += sum(row["loss_mask"])
    return tally


class SampleStore:
    """The samples folder `out_dir` of one run key (`run_key`), as the sampling phase resumes it; `phase`
    names its lines in events.jsonl."""

    def __init__(self, out_dir: Path, key: dict[str, Any], events: RunEvents, phase: str = "sampling"):
        self.out_dir, self.key, self.events, self.phase = out_dir, key, events, phase
        self.responses = responses_per_prompt(key)

    @classmethod
    def of_run(
        cls, config: PipelineConfig, target: TargetModel, prompts: list[Prompt], events: RunEvents
    ) -> SampleStore:
        """The store of `<run_dir>/samples` for these settings, target and prompts."""
        return cls(RunLayout.of(config).samples, run_key(config, target, prompts), events)

    def cached(self) -> SampleSet | None:
        """The finished SampleSet of the same key with no error rows, if its files are intact."""
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
        self.events.record(phase, CACHE_HIT, f"{sample_set.ok} samples at {out_dir} reused", digest=sample_set.digest)
        return sample_set

    def sample_ids(self, prompts: list[Prompt]) -> list[str]:
        """The ids of the rows `prompts` make: each prompt's responses in turn."""
        return [sample_id(p.id, r) for p in prompts for r in range(self.responses)]

    def ok_ids(self) -> set[str]:
        """Ids of the ok rows already in the folder for this run key (none when its rows were made with
        another target or other parameters); reads only the id and status columns, changes nothing."""
        key_path = self.out_dir / KEY_FILE
        if not key_path.exists() or not key_matches(json.loads(key_path.read_text()), row_key(self.key)):
            return set()
        ok: set[str] = set()
        for part in self.out_dir.glob(PART_GLOB):
            table = pq.read_table(part, columns=["id", "status"]).to_pydict()
            ok.update(i for i, status in zip(table["id"], table["status"], strict=True) if status == "ok")
        return ok

    def resume(self, wanted: set[str]) -> set[str]:
        """Leave only ok rows of `wanted` sample ids in the parts (rewriting parts atomically) and return
        their ids. Parts of another run key are removed."""
        out_dir, phase, events = self.out_dir, self.phase, self.events
        out_dir.mkdir(parents=True, exist_ok=True)
        for leftover in out_dir.glob(".part-*.tmp-*"):
            leftover.unlink()
        key_path = out_dir / KEY_FILE
        parts = sorted(out_dir.glob(PART_GLOB))
        if key_path.exists() and not key_matches(json.loads(key_path.read_text()), row_key(self.key), events, phase):
            events.record(phase, DECISION, f"target or sampling parameters changed: discarding {len(parts)} parts")
            for part in parts:
                part.unlink()
            parts = []
        write_text_atomic(key_path, json.dumps(row_key(self.key), sort_keys=True))
        (out_dir / f"{SampleSet.kind}.json").unlink(missing_ok=True)
        kept: set[str] = set()
        dropped: Counter[str] = Counter()
        for part in parts:
            rows = read_part(part)
            keep = []
            for row in rows:
                if row["status"] == "ok" and row["id"] in wanted and row["id"] not in kept:
                    keep.append(row)
                    kept.add(row["id"])
                else:
                    dropped["not asked for" if row["id"] not in wanted else row["status"]] += 1
            if not keep:
                part.unlink()
            elif len(keep) < len(rows):
                write_part(keep, part)
        if parts:
            events.record(
                phase,
                RESUME,
                f"resuming: {len(kept)} ok rows kept, {len(wanted) - len(kept)} rows to sample",
                kept=len(kept),
                dropped=dict(dropped),
            )
        return kept

    def writer(self, rows_per_part: int) -> PartWriter:
        """Where new rows go: parts numbered after those already in the folder."""
        return PartWriter(self.out_dir, rows_per_part)

    def finish(self, target: TargetModel, prompts: list[Prompt], parts: list[Path] | None = None) -> SampleSet:
        """Count every row of `parts` (default: the folder's own), check that each response of each prompt
        has exactly one (`SlicesMismatch` naming the ids otherwise), and save the manifest."""
        out_dir, key = self.out_dir, self.key
        parts = sorted(out_dir.glob(PART_GLOB)) if parts is None else parts
        tally = tally_parts(parts)
        check_each_once(self.sample_ids(prompts), tally.ids.elements(), f"samples at {out_dir}")
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
