"""Which phases of a run are already done and will be skipped, found the way each phase finds it when it
runs (its manifest in `run_dir`, its recorded config key against the key computed now, its upstream
digests against the manifests before it, its files intact), but reading only: nothing is written, no
event is recorded, no weight is loaded. A phase whose input is not done yet is not done either."""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_core.artifacts import DraftCheckpoint, EvalReport, HiddenStateSet, SampleSet, TargetModel, VocabMap
from eagle3_core.config import PipelineConfig
from eagle3_core.dtypes import resolved_config
from eagle3_core.evaluation.phase import cached_report, collect_prompts, measurement_keys, verdict_fields
from eagle3_core.events import RunEvents
from eagle3_core.extraction import phase as extraction
from eagle3_core.online.phase import online_key
from eagle3_core.run_layout import RunLayout
from eagle3_core.sampling.prompts import Prompt
from eagle3_core.sampling.store import SampleStore, key_matches
from eagle3_core.target.hub import cached_snapshot
from eagle3_core.target.prepare import describe_folder, describe_snapshot
from eagle3_core.target.reference import converted_dir, embedded_sha, reference_of
from eagle3_core.training import phase as training
from eagle3_core.vocab import phase_config as vocab_config


@dataclass
class DonePhases:
    """The manifests of the phases already done (None: the phase will run), and the sample rows already ok."""

    target: TargetModel | None = None
    samples: SampleSet | None = None
    hidden_states: HiddenStateSet | None = None
    vocab: VocabMap | None = None
    draft: DraftCheckpoint | None = None
    report: EvalReport | None = None
    ok_rows: int = 0


def known_target(config: PipelineConfig) -> TargetModel | None:
    """The target's manifest without converting, downloading or hashing anything: a local folder or a Hub
    id's complete cached snapshot described in place (weights by digests already kept), the embedded
    target's converted folder if it exists; None where the target is still to be prepared."""
    reference = reference_of(config.target.model)
    if reference.kind == "embedded":
        return TargetModel.load_valid(converted_dir(config.target, embedded_sha(reference.model)))
    folder = cached_snapshot(reference.hub) if reference.hub else reference.folder
    if folder is None or not (folder / "config.json").is_file():
        return None
    if reference.hub is not None:
        return describe_snapshot(reference.hub, folder, config.target.cache_dir, hash_weights=False)
    return describe_folder(folder, folder.name, "local", config.target.cache_dir, hash_weights=False)


def done_samples(config: PipelineConfig, target: TargetModel, prompts: list[Prompt]) -> tuple[SampleSet | None, int]:
    """The finished SampleSet of this run key (no error rows), else None and the rows already ok."""
    store = SampleStore.of_run(config, target, prompts, RunEvents(config.run_dir))  # its reads record nothing
    stored = SampleSet.load_valid(store.out_dir)
    if stored is not None and not stored.error and key_matches(stored.config, store.key):
        return stored, stored.ok
    return None, len(store.ok_ids())


def find_done(config: PipelineConfig, prompts: list[Prompt], target: TargetModel | None) -> DonePhases:
    """Walk the phases in order from the `known_target`, each done only where the one before it is (see the
    module docstring)."""
    done = DonePhases(target=target)
    target, layout = done.target, RunLayout.of(config)
    if target is None:
        return done
    done.samples, done.ok_rows = done_samples(config, target, prompts)
    if done.samples is None:
        return done
    done.hidden_states = extraction.cached_manifest(
        layout.hidden_states, extraction.phase_config(config, target), extraction.upstream_of(done.samples, target)
    )
    stored_vocab = VocabMap.load_valid(layout.vocab)
    vocab_upstream = {"sample_set": done.samples.digest, "target": target.digest}
    if stored_vocab and stored_vocab.config == vocab_config(config, target) and stored_vocab.upstream == vocab_upstream:
        done.vocab = stored_vocab
    online = config.training.data == "online"
    if done.vocab is None or (done.hidden_states is None and not online):
        return done
    upstream = (
        training.online_upstream(done.samples.digest, online_key(config, target), done.vocab, target)
        if online
        else training.upstream_of(done.hidden_states, done.vocab, target)
    )
    done.draft = training.cached_checkpoint(layout.draft.root, training.phase_config(config), upstream)
    if done.draft is None:
        return done
    resolved = resolved_config(config)
    upstream = {"draft_checkpoint": done.draft.digest, "target_model": target.digest, "sample_set": done.samples.digest}
    _, key = measurement_keys(resolved, upstream, collect_prompts(resolved, done.samples))
    done.report = cached_report(layout.eval, key, verdict_fields(resolved))
    return done
