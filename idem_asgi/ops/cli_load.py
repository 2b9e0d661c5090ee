"""What `idem-asgi` imports from the user's project (`MODULE:NAME`): `reconcile`'s hook and transform."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from ..errors import ConfigurationError
from ..transform import AnswerTransform
from .reconcile import Resolver


def load_hook(spec: str) -> Resolver:
    obj = _imported(spec, "--hook must be MODULE:FUNCTION", "hook")
    if not callable(obj):
        raise ConfigurationError(f"hook {spec!r} is not callable")
    resolver: Resolver = obj
    return resolver


def load_transform(spec: str | None) -> AnswerTransform | None:
    if spec is None:
        return None
    obj = _imported(spec, "--transform must be MODULE:NAME", "transform")
    if not isinstance(obj, AnswerTransform):
        raise ConfigurationError(f"transform {spec!r} has no store(response) and load(response) methods")
    return obj


def _imported(spec: str, usage: str, what: str) -> Any:
    """`MODULE:ATTR` (dotted attributes allowed), imported from the current project as `python -m` does."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(f"{usage}, got {spec!r}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` does: hooks in the current project are found
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigurationError(f"{what} module {module_name!r} not found") from None
        raise ConfigurationError(f"importing {what} module {module_name!r} failed: {exc}") from None
    except Exception as exc:
        raise ConfigurationError(
            f"importing {what} module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigurationError(f"{what} module {module_name!r} has no {attr!r}") from None
    return obj
