"""purestep: a pure-functional training core for PyTorch (`purestep.core`, the pure
transforms and the step) with a thin object API (`purestep.api`, the adapter, the
Trainer, checkpoints, configs and the `purestep` command).

Import the halves: `import purestep.core as ps`, `from purestep.api import Trainer`.
"""

from __future__ import annotations

import os as _os

__version__ = "0.4.0"

# In a source checkout core/ and api/ sit beside this folder (pyproject maps them to
# purestep.core and purestep.api); an installed wheel holds them inside it.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_parts = [("core", "__init__.py"), ("api", "__init__.py"), ("pyproject.toml",)]
if all(_os.path.isfile(_os.path.join(_checkout, *p)) for p in _parts) and _checkout not in __path__:
    __path__.append(_checkout)
