"""How `eagle3` presents itself: its commands listed in pipeline order, flags shown without a value type,
and click's usage errors (an unknown option, a missing one) ended like every other mistake: one `error:` line
and exit status 1."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from typer._click.core import Context, Parameter  # typer 0.29 vendors click: its parser raises these
from typer._click.exceptions import NoArgsIsHelpError, UsageError
from typer.core import TyperCommand, TyperGroup, TyperOption

# `eagle3 --help` lists the commands in the order a run takes them; a command not named here follows them.
COMMAND_ORDER = (
    "doctor",
    "config",
    "plan",
    "prepare-target",
    "sample",
    "extract",
    "vocab",
    "train",
    "export",
    "evaluate",
    "serve",
    "run",
    "deploy",
)


def print_error(message: str) -> None:
    """The one line a mistake the user can fix ends with."""
    Console().print(f"error: {message}", highlight=False, markup=False, style="red", soft_wrap=True)


def print_warning(message: str) -> None:
    """A setting that is valid but most likely not meant: said before the command runs, on stderr."""
    Console(stderr=True).print(f"warning: {message}", highlight=False, markup=False, style="yellow", soft_wrap=True)


def in_pipeline_order(names: list[str]) -> list[str]:
    """`names` sorted by COMMAND_ORDER; names it lacks keep their order, after the known ones."""
    rank = {name: index for index, name in enumerate(COMMAND_ORDER)}
    return sorted(names, key=lambda name: rank.get(name, len(COMMAND_ORDER)))


def without_flag_types(params: list[Parameter]) -> list[Parameter]:
    """Flags take no value, so help shows none for them (typer shows `<bool>` otherwise)."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
    return params


def usage_error_line(error: UsageError) -> str:
    """`No such option: --bogus. See `eagle3 evaluate --help`.`: click's sentence, then where the usage is."""
    message = error.format_message().strip()
    message += "" if message.endswith((".", "?")) else "."
    return f"{message} See `{error.ctx.command_path} --help`." if error.ctx is not None else message


@contextmanager
def one_line_usage_errors() -> Iterator[None]:
    """A usage error inside the block ends the program with its `error:` line and exit status 1; a bare
    `eagle3` (NoArgsIsHelpError) still shows the help."""
    try:
        yield
    except NoArgsIsHelpError:
        raise
    except UsageError as error:
        print_error(usage_error_line(error))
        raise typer.Exit(1) from None


def flowing(text: str | None) -> str | None:
    """A docstring's paragraphs with their line breaks undone: typer's help keeps each one, mid-sentence."""
    return None if text is None else re.sub(r"(?<!\n)\n(?!\n)", " ", text)


class PipelineCommand(TyperCommand):
    """A command of `eagle3`: its help text flowing, its flags shown without a value type."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, help=flowing(help), **kwargs)

    def get_params(self, ctx: Context) -> list[Parameter]:
        return without_flag_types(super().get_params(ctx))


class PipelineGroup(TyperGroup):
    """`eagle3` itself: commands in pipeline order, and a usage error of it or of any command (parsed here,
    before the command runs) printed as one `error:` line with exit status 1."""

    def list_commands(self, ctx: Context) -> list[str]:
        return in_pipeline_order(super().list_commands(ctx))

    def get_params(self, ctx: Context) -> list[Parameter]:
        return without_flag_types(super().get_params(ctx))

    def make_context(self, *args: Any, **kwargs: Any) -> Context:
        with one_line_usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Context) -> Any:
        with one_line_usage_errors():
            return super().invoke(ctx)
