"""Generate the configuration reference (docs/configuration.md) from the schema's field docstrings, so the docs
cannot drift from the code: a test regenerates it and compares."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from mmrlhf.config.schema import MMRLHFConfig


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin is typing.Union and type(None) not in typing.get_args(annotation):  # e.g. Literal["auto"] | bool
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Union and len(typing.get_args(annotation)) > 2:  # e.g. Literal["auto"] | int | None
        return " \\| ".join([_type_name(a) for a in typing.get_args(annotation) if a is not type(None)] + ["`None`"])
    text = getattr(annotation, "__name__", None) if origin is None else None
    return f"`{text}`" if text else f"`{str(annotation).replace('typing.', '')}`"


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, BaseModel):
        return "section"
    return f"`{value!r}`"


def _constraints(field: Any) -> str:
    parts = []
    for meta in field.metadata:
        for name, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            bound = getattr(meta, name, None)
            if bound is not None:
                parts.append(f"{sym} {bound}")
    return ", ".join(parts)


def missing_descriptions(model: type[BaseModel] = MMRLHFConfig, prefix: str = "") -> list[str]:
    """Dotted keys whose field has no docstring (every public knob must be documented)."""
    missing = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        if not (field.description or "").strip():
            missing.append(key)
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            missing.extend(missing_descriptions(sub, key + "."))
    return missing


def render_reference() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the schema (`mmrlhf/config/`) by `mmrlhf config docs`; do not edit by hand.",
        "A config is a YAML file of the sections below; any key can be overridden on the command line as",
        "`section.key=value` (values are parsed as YAML). Unknown keys, wrong types and invalid values are errors",
        "that name the key. `mmrlhf config show CONFIG [overrides]` prints the resolved tree;",
        "`mmrlhf config show CONFIG [overrides] --plan` the GPU memory plan of the run instead (docs/gpu.md).",
        "",
    ]
    for section_name, section_field in MMRLHFConfig.model_fields.items():
        section = section_field.annotation
        lines += [f"## `{section_name}`", "", (section_field.description or "").strip(), ""]
        doc = (section.__doc__ or "").strip()
        if doc and not doc.startswith("!!!") and "Usage docs" not in doc:
            lines += [doc, ""]
        lines += ["| key | type | default | constraint | description |", "| --- | --- | --- | --- | --- |"]
        lines += _rows(section, section_name)
        lines.append("")
    return "\n".join(lines)


def _rows(section: type[BaseModel], prefix: str) -> list[str]:
    """One table row per key; a nested section (e.g. ``model.lora``) gets its row, then one row per sub-key."""
    rows = []
    for name, field in section.model_fields.items():
        desc = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{prefix}.{name}` | {_type_name(field.annotation)} | {_default(field)} | "
                    f"{_constraints(field)} | {desc} |")
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            rows += _rows(sub, f"{prefix}.{name}")
    return rows
