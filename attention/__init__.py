"""Token mixers: the part of a block that moves information between positions.

Each variant family lives in its own module and registers a builder under a name; `model.py` asks the
registry for the mixer of each layer (from `attn_pattern`) and never looks at the names itself.
"""

from attention.registry import MIXERS, Mixer, build_mixer, has_window_layers, layer_names, register, validate_config

# importing a variant module registers it
from attention import bridge, gated_deltanet, linear, local, mlstm, moba, mswa, stochastic, swat  # noqa: E402,F401

__all__ = ["MIXERS", "Mixer", "build_mixer", "has_window_layers", "layer_names", "register", "validate_config"]
