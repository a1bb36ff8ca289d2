"""Name -> callable registries: the single dispatch path for estimators, losses, rewards, model adapters.

A registry maps names (and aliases) to objects. Registering a taken name raises; looking up an unknown name raises
listing the valid ones. A name of the form ``package.module:attr`` or ``path/to/file.py:attr`` is resolved by
import, so users can plug in their own function from config without registering it first.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """Unknown or duplicate registry name. ``str()`` gives the plain message (KeyError would quote it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def import_object(spec: str) -> Any:
    """Resolve ``package.module:attr`` or ``path/to/file.py:attr`` (``attr`` may be dotted) to the object.

    Errors name the spec and say which part failed (file missing, import error, attribute missing).
    """
    if ":" not in spec:
        raise RegistryError(f"{spec!r} is not of the form 'package.module:name' or 'path/to/file.py:name'")
    target, attr = spec.rsplit(":", 1)
    if not target or not attr:
        raise RegistryError(f"{spec!r}: both the module (or file) and the name must be given")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise RegistryError(f"{spec!r}: file not found: {path}")
        mod_name = f"mmrlhf_user_{abs(hash(str(path)))}"
        module = sys.modules.get(mod_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(mod_name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise RegistryError(f"{spec!r}: cannot load {path} as a Python module")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[mod_name] = module
            try:
                loader_spec.loader.exec_module(module)
            except Exception:
                del sys.modules[mod_name]
                raise
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise RegistryError(f"{spec!r}: cannot import module {target!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RegistryError(f"{spec!r}: {target!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def check_options(factory: Callable[..., Any], options: dict[str, Any], label: str, *, args: tuple[Any, ...] = (),
                  error: type[Exception] = ValueError) -> None:
    """Refuse, before anything is built, config ``options`` that do not fit ``factory(*args, **options)``: the
    message names ``label`` (``"tool 'calculator'"``), the options and the signature, where a bare TypeError from
    deep inside a run would name neither. A factory without a readable signature (a builtin) passes: its call says
    what is wrong."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **options)
    except TypeError as exc:
        raise error(f"{label}: options {sorted(options)} do not fit {signature}: {exc}") from exc


class Registry(Generic[T]):
    """A named collection of objects of one kind (``kind`` appears in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[T], T]:
        """Decorator: ``@registry.register("grpo", aliases=("group_norm",))``."""

        def deco(obj: T) -> T:
            self.add(name, obj, aliases=aliases)
            return obj

        return deco

    def add(self, name: str, obj: T, *, aliases: tuple[str, ...] = ()) -> None:
        for key in (name, *aliases):
            if key in self._items or key in self._aliases:
                raise RegistryError(f"{self.kind} {key!r} is already registered")
        self._items[name] = obj
        for alias in aliases:
            self._aliases[alias] = name

    def get(self, name: str) -> T:
        """The object registered as ``name`` (or an alias), or imported from ``module:attr``."""
        if name in self._items:
            return self._items[name]
        if name in self._aliases:
            return self._items[self._aliases[name]]
        if ":" in name:
            return import_object(name)
        valid = self.names()
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RegistryError(
            f"unknown {self.kind} {name!r}{hint}; valid names: {', '.join(valid)} "
            f"(or 'package.module:function' / 'path/to/file.py:function')"
        )

    def names(self) -> list[str]:
        """Registered names and aliases, sorted."""
        return sorted([*self._items, *self._aliases])

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def __len__(self) -> int:
        return len(self._items)
