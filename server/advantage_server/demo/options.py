"""Command-line options from a demo's config dataclass: one option per field with a ``flag``."""
from __future__ import annotations

import argparse
from dataclasses import fields


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Add one option per field of the dataclass ``config_cls`` whose metadata has a ``flag``: a
    ``store_true`` switch for a bool field, else an option of the field's type (int, float or str) whose
    help ends with its default."""
    for f in fields(config_cls):
        if "flag" not in f.metadata:
            continue
        if f.type == "bool":
            parser.add_argument(f.metadata["flag"], dest=f.name, action="store_true", help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            default = "" if f.default is None else f" (default {f.default})"
            parser.add_argument(f.metadata["flag"], dest=f.name, type=kind, default=f.default,
                                help=f.metadata["help"] + default)
