"""Shared test helpers: fixture paths (copied from the genuine Cerebras fixtures into tests/fixtures/)."""
from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES
