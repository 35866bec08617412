"""MkDocs hooks: the reference pages are generated at build time from the code itself, never committed, so
they cannot drift from it. `reference/config.md` comes from `PipelineConfig` (field, type, default,
description, and the role each phase gives the field, which decides its cache keys); `reference/cli.md` from
the typer app of `cli/main.py`; `reference/ready-configs.md` from `eagle3 plan` of each ready config
(docs/ready_plans.py); `lab-log.md` is `bench/RESULTS.md` as it stands, and the Benchmarks page takes that
file's "Where things stand" table in place of its marker, so each figure is written once."""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # document this checkout's code, whichever checkout the environment installed

from docs.ready_plans import ready_config_plans  # noqa: E402
from eagle3_core.config import EVERY_PHASE  # noqa: E402

LAB_LOG = REPO / "bench" / "RESULTS.md"
STANDING_MARKER = "<!-- bench/RESULTS.md: where things stand -->"
STANDING_HEADING = "## Where things stand"
ROLE_MEANINGS = {
    "content": "changes what the phase produces: in its resume key and its Prefect cache key",
    "input": "names data the phase is keyed on by content (a prompt file, the target folder, a checkpoint)",
    "operational": "where and how the phase runs: in no key",
    "vllm": "evaluation only: changes measurement (b) inside the serving engine, keyed for (b) alone",
    "verdict": "evaluation only: re-judges saved measurements (the floor); keyed for the verdict alone",
}


def type_name(annotation: Any) -> str:
    """A field's type as a user writes it in YAML: `int | None`, `'vllm' | 'hf'`, `list[str]`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(repr(arg) for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if arg is type(None) else type_name(arg) for arg in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(arg) for arg in args)}]"
    if hasattr(annotation, "__metadata__"):  # an Annotated alias such as the `Switch` of config.py
        return type_name(annotation.__origin__)
    return getattr(annotation, "__name__", str(annotation))


def cell(text: Any) -> str:
    """Text safe inside a markdown table cell."""
    return escape(text).replace("|", "\\|").replace("\n", " ")


def escape(text: Any) -> str:
    """Text whose `<run_dir>` placeholders stay text rather than being read as HTML tags (code spans, between
    backticks, are left as they are)."""
    parts = str(text).split("`")
    return "`".join(part if index % 2 else part.replace("<", "&lt;") for index, part in enumerate(parts))


def default_text(info: Any) -> str:
    value = info.get_default(call_default_factory=True)
    return f"`{value}`" if value not in (None, "") else ("`None`" if value is None else '`""`')


def phase_role(phase: str, role: str, keyed_roles: tuple[str, ...]) -> str:
    """`phase: role`, the phase in bold where the role puts the field in its cache key."""
    name = "every phase" if phase == EVERY_PHASE else phase
    return f"**{name}**: {role}" if role in keyed_roles else f"{name}: {role}"


def config_reference() -> str:
    """Markdown: every field of `PipelineConfig`, a table per section, with the phases that read it."""
    from eagle3_core.config import PipelineConfig
    from eagle3_core.phases import KEYED_ROLES, PHASES, config_fields, marked_roles

    lines = [
        "# Configuration reference",
        "",
        "Generated at build time from `eagle3_core.config.PipelineConfig`: this page is the code. Every",
        "command takes `--config FILE` and any number of `--set section.field=value`; `eagle3 config` prints",
        "the resolved tree. An unknown field fails before anything runs, naming the field and the file.",
        "",
        "**Phases** lists each phase that reads the field and the field's role there; the phases in bold key on",
        f"it: their cache key holds the fields whose role is one of {', '.join(f'`{r}`' for r in KEYED_ROLES)}.",
        "Change such a field and that phase (and every phase after it) runs again; change an `operational`",
        "field and nothing runs again.",
        "",
        *[f"- `{role}`: {meaning}" for role, meaning in ROLE_MEANINGS.items()],
        "",
        "Phases, in order: " + ", ".join(f"`{spec.name}`" for spec in PHASES) + ".",
    ]
    fields = list(config_fields())
    for section, section_info in PipelineConfig.model_fields.items():
        rows = [(path, info) for path, info in fields if path == section or path.startswith(section + ".")]
        lines += ["", f"## `{section}`", "", section_info.description or ""]
        lines += ["", "| field | type | default | description | phases |", "| --- | --- | --- | --- | --- |"]
        for path, info in rows:
            roles = ", ".join(phase_role(phase, role, KEYED_ROLES) for phase, role in marked_roles(info).items())
            lines.append(
                f"| `{path}` | `{cell(type_name(info.annotation))}` | {cell(default_text(info))} "
                f"| {cell(info.description or '')} | {cell(roles)} |"
            )
    return "\n".join(lines) + "\n"


def option_row(param: Any) -> str:
    """One row of a command's table: its flags (or argument), type, default and help."""
    names = ", ".join(f"`{name}`" for name in (*param.opts, *param.secondary_opts))
    kind = "flag" if getattr(param, "is_flag", False) else type_name(param.type_descriptor.annotation)
    default = "" if param.default is None or param.required else f"`{param.default}`"
    return f"| {names} | {cell(kind)} | {cell(default)} | {cell(getattr(param, 'help', '') or '')} |"


def cli_reference() -> str:
    """Markdown: every `eagle3` command with its help text and options, from the typer app."""
    import typer.main

    from cli.main import app

    group = typer.main.get_command(app)
    lines = ["# CLI reference", "", "Generated at build time from the typer app of `cli/main.py`.", ""]
    lines += [f"`eagle3 [OPTIONS] COMMAND ...`: {group.help}", "", "| option | type | default | help |"]
    lines += ["| --- | --- | --- | --- |", *(option_row(p) for p in group.params if p.name != "help")]
    for name, command in sorted(group.commands.items()):
        lines += ["", f"## `eagle3 {name}`", "", escape(command.help or "").strip(), ""]
        params = [p for p in command.params if p.name != "help"]
        if params:
            lines += ["| option | type | default | help |", "| --- | --- | --- | --- |"]
            lines += [option_row(p) for p in params]
    return "\n".join(lines) + "\n"


GENERATED = {
    "reference/config.md": config_reference,
    "reference/cli.md": cli_reference,
    "reference/ready-configs.md": lambda: ready_config_plans(),
    "lab-log.md": lambda: LAB_LOG.read_text(),
}


def on_files(files: Any, config: Any) -> Any:
    """Add the generated pages to the site before navigation and links are resolved."""
    from mkdocs.structure.files import File

    for uri, make in GENERATED.items():
        files.append(File.generated(config, uri, content=make()))
    return files


def where_things_stand(log: str) -> str:
    """The body of the lab log's "Where things stand" section (up to the next heading of any level 1-2)."""
    _, found, rest = log.partition(STANDING_HEADING + "\n")
    if not found:
        raise ValueError(f"bench/RESULTS.md has no '{STANDING_HEADING}' section")
    body = []
    for line in rest.splitlines():
        if line.startswith(("# ", "## ")):
            break
        body.append(line)
    return "\n".join(body).strip() + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Put the lab log's current figures where a page asks for them."""
    if STANDING_MARKER in markdown:
        return markdown.replace(STANDING_MARKER, where_things_stand(LAB_LOG.read_text()))
    return markdown
