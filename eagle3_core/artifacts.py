"""Typed manifests, one per phase: small pydantic records of what a phase wrote (paths, counts, content
digests, the config that made it), never the data itself.

Each file's sha256 is recorded once, when it is written. `validate()` checks that every file exists with
its recorded size; it re-hashes only files whose modification time changed, so a re-run does not read
hundreds of GB, yet an edited file is caught. `validate(deep=True)` re-hashes everything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, model_validator

from eagle3_core.files import sha256_file, sha256_json, write_text_atomic


class ArtifactInvalid(RuntimeError):
    """A manifest whose files are missing or changed; the phase that made it must run again."""


def field_errors(exc: ValidationError) -> str:
    """`files.0.bytes: Input should be a valid integer; ...`: each failing field by its path."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors())


class FileRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str = Field(description="Path relative to the manifest's root.")
    bytes: int = Field(description="Size when written.")
    sha256: str = Field(description="Content digest when written.")
    mtime_ns: int = Field(description="Modification time when written; a change triggers a re-hash.")

    @classmethod
    def of(cls, path: Path, root: Path, sha256: str | None = None) -> FileRecord:
        """Record a file just written under `root`: `sha256` when its writer hashed it while writing, else
        the file is hashed once here."""
        stat = path.stat()
        return cls(
            path=str(path.relative_to(root)),
            bytes=stat.st_size,
            sha256=sha256 or sha256_file(path),
            mtime_ns=stat.st_mtime_ns,
        )

    def problem(self, root: Path, deep: bool = False) -> str | None:
        """Why this file no longer matches its record, or None."""
        path = root / self.path
        if not path.is_file():
            return f"{path}: missing"
        stat = path.stat()
        if stat.st_size != self.bytes:
            return f"{path}: size {stat.st_size} != recorded {self.bytes}"
        if (deep or stat.st_mtime_ns != self.mtime_ns) and sha256_file(path) != self.sha256:
            return f"{path}: content changed since it was written (sha256 differs)"
        return None


class Manifest(BaseModel):
    """Base of every phase's output. `root` is where the files live; it is not part of the digest, so
    moving a run directory keeps every cache key."""

    model_config = ConfigDict(extra="forbid")
    kind: ClassVar[str] = "manifest"
    not_digested: ClassVar[frozenset[str]] = frozenset({"root", "digest"})  # fields the digest leaves out
    # Fields added later that the digest leaves out where empty, so manifests written before keep their digests.
    digested_when_set: ClassVar[frozenset[str]] = frozenset()
    format_version: int = Field(1, description="Bumped when the phase's on-disk format changes.")
    root: str = Field(description="Folder holding the files.")
    files: list[FileRecord] = Field(default_factory=list, description="Every file the phase wrote.")
    config: dict[str, Any] = Field(default_factory=dict, description="The config fields that made it.")
    upstream: dict[str, str] = Field(default_factory=dict, description="Digests of the manifests it read.")

    @model_validator(mode="before")
    @classmethod
    def _drop_serialised_digest(cls, data: Any) -> Any:
        """`digest` is derived from the content; a serialised copy is recomputed, never trusted."""
        if isinstance(data, dict) and "digest" in data:
            data = {k: v for k, v in data.items() if k != "digest"}
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def digest(self) -> str:
        content = self.model_dump(mode="json", exclude=set(self.not_digested))
        for name in self.digested_when_set:
            if not content[name]:
                del content[name]
        content["files"] = sorted((f["path"], f["sha256"]) for f in content["files"])
        return sha256_json({"kind": self.kind, **content})

    @property
    def root_path(self) -> Path:
        return Path(self.root)

    def path_of(self, relative: str) -> Path:
        return self.root_path / relative

    def validate(self, deep: bool = False) -> None:  # type: ignore[override]
        """Raise `ArtifactInvalid` naming every missing or changed file."""
        problems = [p for f in self.files if (p := f.problem(self.root_path, deep))]
        if problems:
            raise ArtifactInvalid(f"{self.kind} at {self.root} is invalid:\n  " + "\n  ".join(problems))

    def is_valid(self, deep: bool = False) -> bool:
        try:
            self.validate(deep)
        except ArtifactInvalid:
            return False
        return True

    def save(self, path: Path | None = None) -> Path:
        """Write the manifest as JSON (atomically), by default to `<root>/<kind>.json`."""
        path = path or self.root_path / f"{self.kind}.json"
        write_text_atomic(path, self.model_dump_json(indent=2))
        return path

    @classmethod
    def load(cls, path: Path | str) -> Any:
        path = Path(path)
        if path.is_dir():
            path = path / f"{cls.kind}.json"
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ArtifactInvalid(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        return cls.from_json(text, source=str(path))

    @classmethod
    def load_valid(cls, folder: Path) -> Any:
        """The manifest saved in `folder` if it exists, parses and its files are intact; else None."""
        path = Path(folder) / f"{cls.kind}.json"
        if not path.exists():
            return None
        try:
            manifest = cls.load(path)
            manifest.validate()
        except (ArtifactInvalid, ValueError, OSError):
            return None
        return manifest

    @classmethod
    def from_json(cls, data: str, source: str = "<json>") -> Any:
        """Parse a manifest; a recorded digest that differs from the content's is an edited manifest.
        Malformed JSON or fields raise `ArtifactInvalid` naming `source` and the line or field."""
        try:
            raw = json.loads(data)
        except json.JSONDecodeError as exc:
            where = f"{source}: line {exc.lineno} column {exc.colno}"
            raise ArtifactInvalid(f"{where}: not valid JSON: {exc.msg}") from None
        except RecursionError:
            raise ArtifactInvalid(f"{source}: JSON nested too deeply to be a manifest") from None
        try:
            manifest = cls.model_validate(raw)
        except ValidationError as exc:
            raise ArtifactInvalid(f"{source}: not a valid {cls.kind}: {field_errors(exc)}") from None
        if "digest" in raw and raw["digest"] != manifest.digest:
            raise ArtifactInvalid(f"{source}: recorded digest does not match the manifest's content")
        return manifest


class TargetText(BaseModel):
    """The fields of the target's text config (`text_config`, or config.json itself) that the draft's shape,
    the loss and the preflights read, named as config.json names them; None where config.json has none."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float | None = None
    rope_theta: int | float | None = None  # as written (an int stays an int in the exported config)
    rope_parameters: dict[str, Any] | None = None
    max_position_embeddings: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2.5) ranks and head dims; kv_lora_rank marks MLA.
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    @classmethod
    def of(cls, text: dict[str, Any]) -> TargetText:
        """The recorded fields of a text config (config.json's `text_config`, or config.json itself)."""
        return cls.model_validate({name: text.get(name) for name in cls.model_fields})


class TargetModel(Manifest):
    kind: ClassVar[str] = "target_model"
    # `text` is read from config.json, which `config_digest` covers, and a Hub target's repo and commit are in
    # `source`: digests stay those of manifests without them.
    not_digested: ClassVar[frozenset[str]] = Manifest.not_digested | {"text", "repo_id", "revision", "commit"}
    name: str = Field(description="Embedded target name, the folder's name, or the Hub repo id.")
    source: str = Field(description="Where it came from: `gguf:<sha256>`, `local` or `hub:<repo id>@<commit sha>`.")
    architecture: str = Field(description="First entry of config.json `architectures`.")
    model_type: str = Field(description="config.json `model_type`.")
    num_layers: int = Field(description="Decoder layers N; aux layer ids default to [2, N//2, N-3].")
    hidden_size: int = Field(description="Hidden size H.")
    vocab_size: int = Field(description="Target vocabulary size.")
    tie_word_embeddings: bool = Field(description="lm_head shares the embedding matrix.")
    config_digest: str = Field(description="sha256 of config.json.")
    tokenizer_digest: str = Field(description="sha256 over the tokenizer files.")
    chat_template: str | None = Field(description="The tokenizer's chat template.")
    weights: dict[str, int] = Field(
        default_factory=dict, description="Weight file -> size; sizes only, weights are never re-hashed."
    )
    text: TargetText | None = Field(
        None,
        description="The text config's fields later phases read, recorded once when the manifest is made (so "
        "config.json is read once); None in a manifest written before they were recorded.",
    )
    repo_id: str | None = Field(None, description="Hugging Face Hub repo id of a target named by one, else None.")
    revision: str | None = Field(None, description="The Hub revision asked for (`main` unless `@revision`).")
    commit: str | None = Field(None, description="The Hub commit sha that revision resolved to: its snapshot.")

    @property
    def recorded_text(self) -> TargetText:
        """`text`; ArtifactInvalid for a manifest written before it was recorded."""
        if self.text is None:
            raise ArtifactInvalid(
                f"{self.kind} at {self.root} was written before the manifest recorded the target's text config: "
                "prepare the target again (`eagle3 prepare-target`)"
            )
        return self.text

    @property
    def text_config(self) -> dict[str, Any]:
        """The recorded text config as config.json names its fields (what `DraftConfig.from_target_config`
        reads), fields config.json lacks left out."""
        shape = {"model_type": self.model_type, "hidden_size": self.hidden_size, "vocab_size": self.vocab_size}
        return {**shape, **self.recorded_text.model_dump(exclude_none=True)}

    @property
    def context_tokens(self) -> int | None:
        """config.json's max_position_embeddings: the longest context vLLM starts the target with (None where
        the manifest or config.json does not say)."""
        return self.text.max_position_embeddings if self.text else None

    def validate(self, deep: bool = False) -> None:  # type: ignore[override]
        super().validate(deep)
        for name, size in self.weights.items():
            path = self.root_path / name
            if not path.is_file() or path.stat().st_size != size:
                raise ArtifactInvalid(f"target weights {path}: missing or not {size} bytes")


class SampleSet(Manifest):
    kind: ClassVar[str] = "sample_set"
    # `responses_per_prompt` is in `config` wherever it is not 1: digests stay those of manifests without it.
    not_digested: ClassVar[frozenset[str]] = Manifest.not_digested | {"responses_per_prompt"}
    digested_when_set: ClassVar[frozenset[str]] = frozenset({"unasked"})
    prompts: int = Field(0, description="Prompts asked for.")
    responses_per_prompt: int = Field(1, description="Responses asked for per prompt, each a row of its own.")
    ok: int = Field(0, description="Rows with a completion.")
    error: int = Field(0, description="Rows whose request failed; reasons in `errors`.")
    skipped: int = Field(0, description="Rows not sent (e.g. prompt longer than the model allows).")
    tokens: int = Field(0, description="Tokens in input_ids over ok rows.")
    loss_tokens: int = Field(0, description="Tokens with loss_mask 1 over ok rows.")
    errors: dict[str, str] = Field(default_factory=dict, description="Sample id -> reason, for error rows.")
    target_digest: str = Field("", description="Digest of the TargetModel sampled from.")
    tokenizer_digest: str = Field("", description="The target tokenizer digest that made input_ids.")
    unasked: list[str] = Field(
        default_factory=list,
        description="Ids of rows in `files` that are not part of this set (sampled for a larger prompt set, "
        "kept for it); every reader skips them.",
    )


class HiddenStateSet(Manifest):
    kind: ClassVar[str] = "hidden_state_set"
    layer_ids: list[int] = Field(default_factory=list, description="Aux layer ids, vLLM's convention.")
    dtype: str = Field("bf16", description="Storage dtype: bf16 or fp8 (e4m3 with per-row scales).")
    hidden_size: int = Field(0, description="Hidden size H.")
    samples: int = Field(0, description="Samples stored.")
    tokens: int = Field(0, description="Tokens stored.")
    bytes_per_token: float = Field(0.0, description="Disk bytes per stored token.")
    last_state_normed: bool = Field(
        False, description="True if the stored last state is after the target's final norm."
    )
    backend: str = Field("", description="vllm or hf.")


class VocabMap(Manifest):
    kind: ClassVar[str] = "vocab_map"
    draft_vocab_size: int = Field(0, description="Tokens in the draft vocabulary.")
    target_vocab_size: int = Field(0, description="Tokens in the target vocabulary.")
    coverage: float = Field(0.0, description="Share of loss-masked tokens inside the draft vocabulary.")
    sample_set_digest: str = Field("", description="Digest of the SampleSet it was counted on.")


class DraftCheckpoint(Manifest):
    kind: ClassVar[str] = "draft_checkpoint"
    step: int = Field(0, description="Optimizer steps trained.")
    layer_ids: list[int] = Field(default_factory=list, description="Aux layer ids written into config.json.")
    metrics: dict[str, float] = Field(default_factory=dict, description="Final training/validation metrics.")


class EvalReport(Manifest):
    kind: ClassVar[str] = "eval_report"
    num_speculative_tokens: int = Field(3, description="k, draft tokens per step.")
    acceptance_length: float = Field(
        0.0, description="Tokens per target verification step: measurement (a), or (b) where (a) is off."
    )
    per_position: list[float] = Field(
        default_factory=list, description="Acceptance rate per position: (a), or (b) where (a) is off."
    )
    speedup: float | None = Field(None, description="Output tokens/s with the drafter over without.")
    tau_by_k: list[float] = Field(default_factory=list, description="(a): tau for k = 1..k_a (derived).")
    vllm_acceptance_length: float | None = Field(None, description="Tokens per target step in vLLM (b).")
    vllm_per_position: list[float] = Field(default_factory=list, description="Acceptance rate per position (b).")
    guard_failure: str | None = Field(None, description="Why the acceptance guard failed; None if it passed.")
    measurements: dict[str, Any] = Field(
        default_factory=dict, description="Per prompt set and engine: tau, per-position rates, tokens/s."
    )


def record_files(root: Path, paths: list[Path]) -> list[FileRecord]:
    """FileRecords for files just written under `root`, in the given order."""
    return [FileRecord.of(Path(p), Path(root)) for p in paths]
