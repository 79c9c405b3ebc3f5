"""benchmarks/critical_path.py times the router's path by wrapping router functions it names:
each name must still be the router's, and one that is not stops the run with its name instead
of its marks silently going missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from kvrouter.router.engine import RoutingEngine

ROOT = Path(__file__).resolve().parent.parent


def _critical_path() -> ModuleType:
    spec = importlib.util.spec_from_file_location("critical_path", ROOT / "benchmarks" / "critical_path.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_mark_wraps_a_function_the_router_has() -> None:
    cp = _critical_path()
    assert cp.missing_hooks(cp.BASE_HOOKS) == []
    assert cp.missing_hooks(cp.DETAIL_HOOKS) == []


def test_a_renamed_function_stops_the_run_with_its_name(monkeypatch, tmp_path: Path) -> None:
    cp = _critical_path()
    monkeypatch.delattr(RoutingEngine, "place")  # as if renamed
    with pytest.raises(SystemExit, match="engine:RoutingEngine.place"):
        cp._install_marks(str(tmp_path / "marks.json"), detail=False)  # (raises before wrapping anything)
