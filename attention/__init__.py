"""Token mixers: the part of a block that moves information between positions.

Each variant family lives in its own module and registers itself (`@register("name")` on its Mixer class,
with the Settings it declares); importing this package imports every module in it, so a module dropped into
attention/ is found with nothing else to edit. `model.py` asks the registry for the mixer of each layer (from
`attn_pattern`) and never looks at the names itself; the tools enumerate the registry.
"""

import importlib
import pkgutil

from attention.registry import (MIXERS, SETTINGS, Mixer, Setting, build_mixer, has_window_layers, layer_names,
                                register, validate_config)

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):  # every module: the variants register
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["MIXERS", "SETTINGS", "Mixer", "Setting", "build_mixer", "has_window_layers", "layer_names", "register",
           "validate_config"]
