"""Optional dependencies, imported where a feature needs them.

scipy (t quantiles, significance tests) and matplotlib (the plots of ``embbench report``)
are dependencies of the package, but a machine may have embbench installed without them
(``pip install --no-deps``). Nothing that ``embbench run`` imports at start-up imports them,
and a feature that needs one that is missing fails alone with :class:`MissingDependency`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingDependency", "require"]


class MissingDependency(ImportError):
    """A feature needs a package that is not installed here; the message says which and how
    to install it."""


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` (e.g. ``"scipy.stats"``) for ``feature``.

    Raises:
        MissingDependency: the module cannot be imported; the message names the feature,
            the package and the command that installs it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = module.partition(".")[0]
        raise MissingDependency(f"{feature} needs {package}, which cannot be imported here ({e}); "
                                f"install it with: pip install {package}") from None
