"""The random number generators' states, as checkpoints keep them per process: an exact resume draws what the
uninterrupted run would have drawn (dropout, sa's permutations)."""

import random

import numpy as np
import torch

from runtime.checkpoint import CheckpointError


def rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, cached),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore rng_state()'s output. Generator states must be CPU ByteTensors (torch.set_rng_state and
    torch.cuda.set_rng_state take nothing else): a checkpoint loaded onto a GPU (map_location=cuda) is refused
    with the fix instead of failing inside torch."""
    for key in ("torch", "cuda"):
        value = state.get(key)
        if value is not None and not (isinstance(value, torch.Tensor) and value.device.type == "cpu"
                                      and value.dtype == torch.uint8):
            where = f"a {value.dtype} tensor on {value.device}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointError(f"the saved {key} RNG state is {where}, not a CPU ByteTensor: load checkpoints "
                                  "with map_location='cpu' and move only model and optimizer state to the device")
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
