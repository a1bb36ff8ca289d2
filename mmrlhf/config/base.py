"""The base of every config section: frozen, strict, and self-describing.

Why pydantic (v2) rather than OmegaConf structured configs: it is already a hard dependency of vLLM and FastAPI,
its validation is strict and typed (``Literal`` choices, ``Field(gt=0)`` bounds, custom validators) and every error
carries the path of the offending key, which we turn into messages that name the key and the allowed values.
OmegaConf would add a dependency whose validation stops at primitive types.

Sections are plain data: frozen (nothing mutates config at run time), ``extra="forbid"`` (an unknown key is an
error, not a silently ignored typo), ``strict`` numbers off so that ``1`` may fill a ``float`` field.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base class of all config sections. Subclass it and document every field with ``Field(description=...)``."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_default=True,
        use_attribute_docstrings=True,
        protected_namespaces=(),
    )
