"""The engine's command-line flags, generated from EngineConfig's fields: one definition for every command that
runs a model (generate, chat, cache-tree, serve, bench), so none of them misses an option.

Flags are the field names with dashes (vLLM's names where they exist) plus vLLM's aliases: --block-size,
--kv-cache-memory-bytes, --enable-prefix-caching / --no-enable-prefix-caching.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from prefixkv.config import EngineConfig

_TYPES = typing.get_type_hints(EngineConfig)


def _parser_for(name: str) -> Any:
    """int / str for a field; for an optional one, also 'none' for None (e.g. --seed none, --lpm-fallback-threshold
    none)."""
    hint = _TYPES[name]
    if typing.get_origin(hint) is typing.Literal:  # a choice list: argparse checks the choices
        return str
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    base = next(a for a in args if a is not type(None)) if args else hint
    if not args:
        return base

    def parse(text: str) -> Any:
        return None if text.lower() == "none" else base(text)

    parse.__name__ = base.__name__  # argparse names the type in its error messages
    return parse


def add_engine_args(
    parser: argparse.ArgumentParser, exclude: Collection[str] = (), aliases: Mapping[str, Sequence[str]] | None = None
) -> None:
    """One flag per EngineConfig field, with its help text, choices and default; `exclude` leaves fields out (the
    simulator has no model), `aliases` adds flags for a field (e.g. --cache for prefix_cache)."""
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineConfig):
        if f.name in exclude:
            continue
        meta = f.metadata
        flags = [f"--{f.name.replace('_', '-')}", *meta.get("aliases", ()), *(aliases or {}).get(f.name, ())]
        default = f.default
        shown = "" if default is None else f" (default: {default})"
        if _TYPES[f.name] is bool:  # --x / --no-x
            group.add_argument(
                *flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=meta.get("help", "")
            )
            continue
        group.add_argument(
            *flags,
            dest=f.name,
            type=_parser_for(f.name),
            default=default,
            choices=meta.get("choices"),
            help=meta.get("help", "") + shown,
        )
    group.add_argument(
        "--no-enable-prefix-caching",
        dest="prefix_cache",
        action="store_const",
        const="off",
        help="vLLM's switch: the same as --prefix-cache off",
    )
    group.add_argument(
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_true",
        default=None,
        help="vLLM's switch: keeps the --prefix-cache kind (an error with --prefix-cache off)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options in parsed arguments, as EngineConfig.from_kwargs takes them."""
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    if getattr(args, "enable_prefix_caching", None) is not None:
        kwargs["enable_prefix_caching"] = args.enable_prefix_caching
    return kwargs


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(**engine_kwargs(args))
