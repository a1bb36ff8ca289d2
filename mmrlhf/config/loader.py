"""Load a config: YAML file -> dotted overrides -> validation -> frozen ``MMRLHFConfig``.

Every failure raises :class:`ConfigError` whose message names the dotted key (``trainer.lr``) and, where the key
has a fixed set of values or keys, lists them. Nothing here reads global state; the caller passes paths and
override strings (the CLI passes ``sys.argv`` remainders).
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml
from pydantic import BaseModel, ValidationError

from mmrlhf.config.schema import MMRLHFConfig


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"trainer.lr=1e-6"`` into ``(["trainer", "lr"], 1e-06)``.

    The value is parsed as YAML (so ``true``, ``[1, 2]``, ``null`` and numbers work; ``1e-6`` is read as a
    float even though YAML 1.1 would call it a string).
    """
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key or key part")
    return key.split("."), _parse_value(raw)


def _parse_value(raw: str) -> Any:
    try:
        return float(raw) if _looks_like_float(raw) else yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot parse value {raw!r}: {exc}") from None


def _looks_like_float(raw: str) -> bool:
    s = raw.strip().lower()
    if not any(c in s for c in "e."):
        return False
    try:
        float(s)
    except ValueError:
        return False
    return s not in {"nan", "inf", "-inf", "+inf", "infinity"}


def _locate(loc: Sequence[str]) -> tuple[dict[str, Any] | None, str]:
    """For a pydantic error location: the fields of the section holding its last key (None where the path leads to
    no section) and the dotted key as a user writes it. Inside a name -> section mapping (``reward.label_map``) the
    entry's name is kept and the union tag pydantic adds (``judge`` in ``label_map.j.judge.model``) is dropped: the
    entry's section is the union member of that tag."""
    current: Any = MMRLHFConfig
    shown: list[str] = []
    i = 0
    while i < len(loc) - 1:
        fields = getattr(current, "model_fields", None) or {}
        part = loc[i]
        shown.append(part)
        i += 1
        if part not in fields:
            return None, ".".join(shown + list(loc[i:]))
        annotation = fields[part].annotation
        if _is_mapping(annotation) and i < len(loc) - 1:
            shown.append(loc[i])  # the entry's name
            i += 1
            members = _models_in(typing.get_args(annotation)[-1] if typing.get_args(annotation) else annotation)
            tagged = {tag: m for m in members for tag in typing.get_args(
                getattr(m.model_fields.get("type"), "annotation", None))}
            if i < len(loc) - 1 and loc[i] in tagged:
                current = tagged[loc[i]]
                i += 1
            elif len(members) == 1:
                current = members[0]
            else:
                return None, ".".join(shown + list(loc[i:]))
            continue
        current = _section_type(annotation)
        if current is None:
            return None, ".".join(shown + list(loc[i:]))
    return getattr(current, "model_fields", None), ".".join(shown + list(loc[i:]))


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a type annotation names (through unions, ``Annotated``, ``Optional``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_type(arg)
        if found is not None:
            return found
    return None


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``key.path=value`` override applied (later ones win)."""
    out = _deep_copy(data)
    for text in overrides:
        path, value = parse_override(text)
        _check_path(path, text)
        node = out
        for depth, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(
                    f"override {text!r}: {'.'.join(path[: depth + 1])} is a value, not a section"
                )
            node = child
        node[path[-1]] = value
    return out


def _check_path(path: list[str], text: str) -> None:
    """Reject an override whose key does not exist before it reaches validation (better suggestions).

    Keys inside a free-form mapping field (e.g. ``reward.recipe.<label>``) are not checked here: validation does.
    """
    current: type[BaseModel] = MMRLHFConfig
    for depth, part in enumerate(path):
        fields = current.model_fields
        if part not in fields:
            raise ConfigError(_unknown_key_message(".".join(path[: depth + 1]), part, fields))
        if depth == len(path) - 1:
            return
        annotation = fields[part].annotation
        if _is_mapping(annotation):  # before the section test: dict[str, SomeSection] is a mapping, not that section
            return
        section = _section_type(annotation)
        if section is None:
            raise ConfigError(f"override {text!r}: {'.'.join(path[: depth + 1])} is a value, not a section")
        current = section


def _is_mapping(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (dict, typing.Dict) or (isinstance(origin, type) and issubclass(origin, Mapping)):
        return True
    return any(_is_mapping(arg) for arg in typing.get_args(annotation))


# Keys that moved: the old key's error names its replacement (in a YAML file and on the command line alike).
MOVED_KEYS = {
    "distributed.activation_checkpointing": "trainer.gradient_checkpointing (it applies in every launch mode)",
}


def _unknown_key_message(dotted: str, name: str, fields: Mapping[str, Any]) -> str:
    if dotted in MOVED_KEYS:
        return f"config key {dotted!r} was replaced by {MOVED_KEYS[dotted]}"
    valid = sorted(fields)
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown config key {dotted!r}{hint}; valid keys here: {', '.join(valid)}"


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming the dotted key, what was wrong, and the allowed values where known."""
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        fields, dotted = _locate(loc)
        if err["type"] == "extra_forbidden":
            lines.append(_unknown_key_message(dotted, loc[-1], fields or {}))
            continue
        msg = err["msg"]
        if err["type"] == "value_error":  # a validator's own message (it names its keys): without pydantic's prefix
            msg = msg.removeprefix("Value error, ")
        if err["type"] == "literal_error":
            expected = err.get("ctx", {}).get("expected", "")
            msg = f"invalid value {err.get('input')!r}; allowed values: {expected}"
        elif "input" in err and not isinstance(err["input"], (dict, list)):
            msg = f"{msg} (got {err['input']!r})"
        # a check across sections (the whole config's validator) has no key of its own: its message names them
        lines.append(f"config key {dotted!r}: {msg}" if dotted else f"config: {msg}")
    return "\n".join(lines)


def build_config(data: Mapping[str, Any] | None = None, overrides: Sequence[str] = ()) -> MMRLHFConfig:
    """Validate a plain dict (plus overrides) into the frozen config tree."""
    merged = apply_overrides(dict(data or {}), overrides)
    try:
        return MMRLHFConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> MMRLHFConfig:
    """Read ``path`` (YAML; None for all defaults), apply ``overrides``, validate."""
    data: Any = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return build_config(data, overrides)


def dump_config(config: BaseModel) -> str:
    """The resolved config as YAML (round-trips through :func:`load_config`)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
