"""`lightning_slide.ops` for a source checkout imported without installing it (``PYTHONPATH=<checkout>``).

The kernels live in the repository's top-level ``ops/`` folder, which pyproject.toml's ``package-dir`` maps
to ``lightning_slide.ops``: a wheel holds them at ``lightning_slide/ops/``, and an editable install resolves
the name through setuptools' own finder. With the checkout merely on the path nothing maps the folder, so
this finder does, for that one name (its submodules then load from the package's ``__path__``). It goes
last on ``sys.meta_path``, so it answers only where no installed package did. The package imports this
module before any other of its own, so any module of it may import ``lightning_slide.ops``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

OPS_NAME = "lightning_slide.ops"
CHECKOUT_OPS = Path(__file__).resolve().parent.parent / "ops"


class CheckoutOpsFinder(MetaPathFinder):
    """Finds `lightning_slide.ops` in the checkout's top-level ``ops/`` folder."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != OPS_NAME:
            return None
        return importlib.util.spec_from_file_location(
            fullname, CHECKOUT_OPS / "__init__.py", submodule_search_locations=[str(CHECKOUT_OPS)]
        )


def map_checkout_ops() -> None:
    """Register the finder once, where this package has no ``ops`` of its own and a checkout's is beside it.

    An installed wheel has ``lightning_slide/ops/``, so nothing is registered there.
    """
    if (Path(__file__).parent / "ops").is_dir() or not (CHECKOUT_OPS / "__init__.py").is_file():
        return
    if not any(isinstance(finder, CheckoutOpsFinder) for finder in sys.meta_path):
        sys.meta_path.append(CheckoutOpsFinder())


map_checkout_ops()
