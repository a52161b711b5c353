"""Command-line and file loading for the settings schema.

Flags are generated from the dataclass fields (`model_path` -> `--model-path`), so a
knob added to `settings.py` is a flag with its help line at once. Precedence:
defaults < `--config FILE` (TOML or JSON) < explicit flags.
"""

from __future__ import annotations

import argparse
import json
import tomllib
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from config.settings import EngineSettings, ServerSettings, SettingsError, settings_fields


def _base_type(hint: Any) -> tuple[Any, bool]:
    """Strip `X | None` to (X, nullable)."""
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _parse_optional(conv: Any) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "null", "auto") else conv(text)

    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    group = parser.add_argument_group(cls.__name__)
    for f, hint in settings_fields(cls):
        flag = "--" + f.name.replace("_", "-")
        base, nullable = _base_type(hint)
        help_text = f"{f.metadata['help']} (default: {f.default})"
        # default=SUPPRESS: only flags the user typed reach the namespace, so a
        # config file's values are not clobbered by defaults.
        if base is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        elif get_origin(base) is Literal:
            group.add_argument(flag, choices=get_args(base), default=argparse.SUPPRESS, help=help_text)
        else:
            conv = _parse_optional(base) if nullable else base
            group.add_argument(flag, type=conv, default=argparse.SUPPRESS, help=help_text, metavar=base.__name__.upper())


def load_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    return {k.replace("-", "_"): v for k, v in data.items()}


def split_settings(values: dict[str, Any]) -> tuple[EngineSettings, ServerSettings]:
    """Build both settings objects from one flat dict; unknown keys are an error."""
    engine_names = {f.name for f, _ in settings_fields(EngineSettings)}
    server_names = {f.name for f, _ in settings_fields(ServerSettings)}
    unknown = set(values) - engine_names - server_names
    if unknown:
        raise SettingsError(f"unknown settings: {', '.join(sorted(unknown))}")
    engine = EngineSettings(**{k: v for k, v in values.items() if k in engine_names})
    server = ServerSettings(**{k: v for k, v in values.items() if k in server_names})
    return engine, server


def build_serve_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="sluice serve", description="Serve an LLM over HTTP.")
    parser.add_argument("--config", default=None, help="TOML or JSON file of settings; flags override it.")
    add_settings_arguments(parser, ServerSettings)
    add_settings_arguments(parser, EngineSettings)
    return parser


def settings_from_args(ns: argparse.Namespace) -> tuple[EngineSettings, ServerSettings]:
    values = dict(vars(ns))
    config_path = values.pop("config", None)
    values.pop("func", None)
    values.pop("command", None)
    merged = load_config_file(config_path) if config_path else {}
    merged.update(values)
    return split_settings(merged)
