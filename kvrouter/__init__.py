"""kvrouter: a KV-cache-aware L7 router for SGLang replicas."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# The sub-packages live at the top of the repository (router/, policies/, metrics/, sglang_protocol/, loadtest/) and
# install as kvrouter.router etc. When Python imports this folder straight from a source checkout
# (e.g. `python -m kvrouter.cli` run in the repository root, which shadows an installed copy),
# let the sub-packages resolve to those top-level folders too.
_here = _Path(__file__).resolve().parent
if not (_here / "router").is_dir() and (_here.parent / "router" / "__init__.py").is_file():
    __path__.append(str(_here.parent))  # type: ignore[name-defined]  # noqa: F821
