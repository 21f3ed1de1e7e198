"""RNGState: every global random number generator of a training process, as a Stateful."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from checkpointd.errors import RestoreMismatchError

__all__ = ["RNGState"]


class RNGState:
    """Captures and restores Python ``random``, NumPy's global generator, torch's CPU
    generator and every CUDA device's generator. Pass it as a component:
    ``writer.save(step, {"rng": RNGState(), ...})``. Call from the training thread."""

    def state_dict(self) -> dict[str, Any]:
        """The current state of every domain, as plain values and tensors (no pickle)."""
        version, internal, gauss = random.getstate()
        np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "python": {"version": version, "state": list(internal), "gauss": gauss},
            "numpy": {
                "kind": np_kind,
                "keys": np.asarray(np_keys).copy(),
                "pos": int(np_pos),
                "has_gauss": int(np_has_gauss),
                "cached_gaussian": float(np_gauss),
            },
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every domain; raise RestoreMismatchError if the payload is incomplete
        or the CUDA devices differ from when it was saved. Changes nothing on error."""
        expected = {"python", "numpy", "torch", "cuda"}
        if not isinstance(state_dict, dict) or set(state_dict) != expected:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise RestoreMismatchError(f"RNG state must have exactly {sorted(expected)}, got {got}")
        cuda_states = list(state_dict["cuda"])
        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(cuda_states) != device_count:
            raise RestoreMismatchError(
                f"RNG state was saved with {len(cuda_states)} CUDA device(s), "
                f"this process has {device_count}"
            )
        py = state_dict["python"]
        npy = state_dict["numpy"]
        python_state = (int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss"])
        numpy_state = (
            str(npy["kind"]),
            np.asarray(npy["keys"], dtype=np.uint32),
            int(npy["pos"]),
            int(npy["has_gauss"]),
            float(npy["cached_gaussian"]),
        )
        torch_state = torch.as_tensor(state_dict["torch"], dtype=torch.uint8).clone()
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if cuda_states:
            torch.cuda.set_rng_state_all(
                [torch.as_tensor(s, dtype=torch.uint8) for s in cuda_states]
            )
