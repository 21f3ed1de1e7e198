"""RNGState: every global random number generator of a training process, as a Stateful."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from checkpointd.errors import RestoreMismatchError
from checkpointd.state.fit import layout_problems
from checkpointd.state.stateful import python_random_state, python_random_tuple

__all__ = ["RNGState"]

_DOMAINS = ("python", "numpy", "torch", "cuda")


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class RNGState:
    """Captures and restores the process-wide generators.

    Python ``random``, NumPy's global generator (``np.random.*``), torch's CPU generator and every
    CUDA device's generator.

    Pass it as a component: ``writer.save(step, {"rng": RNGState(), ...})``. It holds
    no state itself: ``state_dict()`` reads the generators, ``load_state_dict()`` sets
    them. Generators the job owns (a DataLoader's ``torch.Generator``, a
    ``np.random.default_rng()``, a ``random.Random``) are separate components.
    Restoring refuses an incomplete payload and device drift (CUDA then but not
    now, or a different device count) with RestoreMismatchError, before any
    generator changes. Call from the training thread.
    """

    def state_dict(self) -> dict[str, Any]:
        """The current state of every domain.

        Returns:
            Domain name -> its state, as plain values and uint8/uint32 tensors.
        """
        np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
        return {
            "python": python_random_state(random.getstate()),
            "numpy": {
                "kind": str(np_kind),
                "keys": np.asarray(np_keys, dtype=np.uint32).copy(),
                "pos": int(np_pos),
                "has_gauss": int(np_has_gauss),
                "cached_gaussian": float(np_gauss),
            },
            "torch": torch.get_rng_state(),
            "cuda": list(torch.cuda.get_rng_state_all()) if _cuda_count() else [],
        }

    def check_state_dict(self, state_dict: Any) -> None:
        """Check that ``load_state_dict`` would take ``state_dict``; changes nothing.

        Checks the domains (no missing or unexpected ones), the CUDA device count
        and the layout of every domain against this process's generators.

        Args:
            state_dict: A stored RNG state tree.

        Raises:
            RestoreMismatchError: It would not be taken (the message says why).
        """
        if not isinstance(state_dict, Mapping):
            raise RestoreMismatchError(
                f"RNG state must be a mapping of {list(_DOMAINS)}, got {type(state_dict).__name__}"
            )
        missing = sorted(set(_DOMAINS) - set(state_dict))
        unexpected = sorted(map(str, set(state_dict) - set(_DOMAINS)))
        if missing or unexpected:
            raise RestoreMismatchError(
                f"RNG state is incomplete or unknown: missing domains {missing or 'none'}, "
                f"unexpected domains {unexpected or 'none'}"
            )
        saved = state_dict["cuda"]
        if not isinstance(saved, list | tuple):
            raise RestoreMismatchError("RNG state: 'cuda' must be a list of device states")
        now = _cuda_count()
        if len(saved) != now:
            then_text = f"{len(saved)} CUDA device(s)" if saved else "no CUDA device"
            now_text = f"{now} CUDA device(s)" if now else "no CUDA device available"
            raise RestoreMismatchError(
                f"RNG state was saved with {then_text}, this process has {now_text}: the random "
                "streams cannot continue exactly (run with the same devices, or restore with "
                "strict=False without the RNG component to resume non-exactly)"
            )
        problems = layout_problems(self.state_dict(), state_dict)
        if problems:
            raise RestoreMismatchError(f"RNG state does not fit: {'; '.join(problems[:8])}")
        if state_dict["numpy"]["kind"] != "MT19937":
            raise RestoreMismatchError(
                f"RNG state: NumPy generator kind {state_dict['numpy']['kind']!r} is not MT19937"
            )

    def load_state_dict(self, state_dict: Any) -> None:
        """Set every domain from ``state_dict``, all or nothing.

        If setting one generator fails, the ones already set are put back.

        Args:
            state_dict: A stored RNG state tree (``state_dict()``'s).

        Raises:
            RestoreMismatchError: As ``check_state_dict``, before any generator changes.
        """
        self.check_state_dict(state_dict)
        py = python_random_tuple(state_dict["python"])
        npy = state_dict["numpy"]
        numpy_state = (
            "MT19937",
            np.asarray(npy["keys"], dtype=np.uint32).copy(),
            int(npy["pos"]),
            int(npy["has_gauss"]),
            float(npy["cached_gaussian"]),
        )
        torch_state = torch.as_tensor(state_dict["torch"], dtype=torch.uint8).clone()
        cuda_states = [torch.as_tensor(s, dtype=torch.uint8).clone() for s in state_dict["cuda"]]
        before = self.state_dict()
        done: list[str] = []  # domains already set, to put back if a later one fails
        try:
            random.setstate(py)
            done.append("python")
            np.random.set_state(numpy_state)
            done.append("numpy")
            torch.set_rng_state(torch_state)
            done.append("torch")
            if cuda_states:
                done.append("cuda")  # set device by device: a failure may leave some set
                torch.cuda.set_rng_state_all(cuda_states)
        except Exception as exc:
            self._put_back(before, done)
            raise RestoreMismatchError(f"RNG state was refused: {exc}") from exc
        except BaseException:
            self._put_back(before, done)
            raise

    @staticmethod
    def _put_back(state: dict[str, Any], domains: list[str]) -> None:
        """Set ``domains`` back to ``state``, which this process produced (rollback path)."""
        if "python" in domains:
            random.setstate(python_random_tuple(state["python"]))
        if "numpy" in domains:
            npy = state["numpy"]
            np.random.set_state(
                ("MT19937", npy["keys"], npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
            )
        if "torch" in domains:
            torch.set_rng_state(state["torch"])
        if "cuda" in domains:
            torch.cuda.set_rng_state_all(state["cuda"])
