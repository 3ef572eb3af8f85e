"""Flags that several commands take, declared once: the output's (bench and every inspect subcommand)
and where inspect looks; the pair's (serve-pair, bench --launch) are in ``kvtool.commands.pairoptions``.

A group of flags is a dataclass whose fields are Typer options; ``with_options`` adds its fields to a
command's signature and hands the command one instance of it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_type_hints

import typer


F = TypeVar("F", bound=Callable[..., Any])


def with_options(**groups: type) -> Callable[[F], F]:
    """Add the fields of each dataclass in ``groups`` as the command's options; the command's parameter
    of the group's name receives the dataclass, built from them."""

    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)
        own = [p for name, p in signature.parameters.items() if name not in groups]
        added = []
        for cls in groups.values():
            hints = get_type_hints(cls, include_extras=True)
            for item in fields(cls):
                kind = inspect.Parameter.KEYWORD_ONLY
                added.append(inspect.Parameter(item.name, kind, default=item.default, annotation=hints[item.name]))
        clash = {p.name for p in own} & {p.name for p in added}
        if clash:
            raise TypeError(f"{command.__name__}: options declared twice: {', '.join(sorted(clash))}")

        # Typer hands the command its click context through a parameter typed typer.Context: it says which
        # flags the command line gave (a group a file fills in, PairOptions with --config, leaves those).
        added.append(inspect.Parameter(_CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))

        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given = _given_on_command_line(kwargs.pop(_CONTEXT, None))
            for group, cls in groups.items():
                built = cls(**{item.name: kwargs.pop(item.name) for item in fields(cls)})
                if hasattr(built, "with_file"):
                    built = built.with_file(given=given)
                kwargs[group] = built
            return command(*args, **kwargs)

        parameters = own + added
        wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        return wrapper  # type: ignore[return-value]

    return decorate


_CONTEXT = "kvtool_click_context"


def _given_on_command_line(context: Any) -> set[str]:
    """The parameters of the running command that its command line (or environment) gave. (By the source's
    name: Typer may carry its own copy of click, whose ParameterSource is another enum.)"""
    if context is None:
        return set()
    given = set()
    for name in context.params:
        source = context.get_parameter_source(name)
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            given.add(name)
    return given


# ---- inspect: where to look -----------------------------------------------------------------

AdminOpt = Annotated[
    str | None,
    typer.Option("--admin", help="the Mooncake master's admin URL (its --metrics_port), e.g. http://127.0.0.1:9003"),
]
ReadyFileOpt = Annotated[
    Path | None, typer.Option("--pair", help="a `kvtool serve-pair --ready-file` to take every address from")
]
MasterOpt = Annotated[
    str | None,
    typer.Option("--master", help="the master's RPC HOST:PORT, to read object bytes \\[default: from --pair]"),
]
NamespaceOpt = Annotated[str | None, typer.Option("--namespace", help="a 16-hex kvtool namespace")]
