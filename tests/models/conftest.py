"""Fixtures of the model-side tests: one loaded tiny model bundle per family, shared by the whole session."""

from __future__ import annotations

import pytest
from models_testing import load_bundle

_BUNDLES: dict = {}


@pytest.fixture(scope="session")
def bundles():
    """family -> Bundle, loaded on first use."""

    class _Lazy:
        def __getitem__(self, family):
            if family not in _BUNDLES:
                _BUNDLES[family] = load_bundle(family)
            return _BUNDLES[family]

    return _Lazy()
