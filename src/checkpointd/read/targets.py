"""Which restore targets take their stored tensors in place, and how: a target whose
``load_state_dict`` is known to copy each stored tensor into its own memory or to keep
the given tensors as they are (inplace.py reads the bytes straight into them). Pure
inspection of the live objects; any thread."""

from __future__ import annotations

import bisect
from typing import Any

import torch

from checkpointd.state.stateful import unwrap

__all__ = ["Taken", "dtensor_lands_in_place", "lands_in_place"]


_OWN_HOOKS = ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_state_dict_pre_hooks")
"""The dicts in which torch keeps a module's state-dict hooks that FSDP2 also registers
(private: torch has no public way to ask whether one is registered), read by name as
the optimizer's below."""


def _from_torch(method: Any) -> bool:
    return str(getattr(method, "__module__", "")).startswith("torch.")


def _fsdp_hook(hook: Any) -> bool:
    """A hook FSDP2 registers itself: per parameter, a load post-hook that re-points its
    sharded parameter at the loaded local tensor (a no-op when that tensor is its own);
    per parameter group, a state-dict and a load pre-hook that reshard the parameters
    first (``to_sharded_hook``). None of them touches a tensor's values."""
    hook = getattr(hook, "hook", hook)  # torch wraps module-taking hooks (_WrappedHook)
    qualname = str(getattr(hook, "__qualname__", ""))
    module = str(getattr(hook, "__module__", ""))
    return qualname.startswith("FSDPParam") and module.startswith("torch.distributed.fsdp.")


def _plain_module(module: torch.nn.Module, *, fsdp2: bool = False) -> bool:
    """No hooks, no extra state, and torch's own state-dict methods in every submodule:
    then ``load_state_dict`` copies each stored tensor into the live one, nothing else.
    ``fsdp2``: FSDP2's own hooks (``_fsdp_hook``) are allowed too."""
    for sub in module.modules():
        kind = type(sub)
        hooks = [hook for name in _OWN_HOOKS for hook in getattr(sub, name).values()]
        if (
            not all(fsdp2 and _fsdp_hook(hook) for hook in hooks)
            or getattr(sub, "_state_dict_hooks")  # noqa: B009 - torch's private dict, by name
            or kind.get_extra_state is not torch.nn.Module.get_extra_state
            or not all(
                _from_torch(getattr(kind, attr))
                for attr in ("_load_from_state_dict", "_save_to_state_dict", "state_dict")
            )
        ):
            return False
    return type(module).load_state_dict is torch.nn.Module.load_state_dict


def _plain_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """torch's own ``state_dict``/``load_state_dict`` and no hooks on them."""
    kind = type(optimizer)
    hooks = (
        "_optimizer_load_state_dict_pre_hooks",
        "_optimizer_load_state_dict_post_hooks",
        "_optimizer_state_dict_pre_hooks",
        "_optimizer_state_dict_post_hooks",
    )
    return (
        kind.load_state_dict is torch.optim.Optimizer.load_state_dict
        and kind.state_dict is torch.optim.Optimizer.state_dict
        and not any(getattr(optimizer, hook, None) for hook in hooks)
    )


def lands_in_place(target: Any) -> str | None:
    """How ``load_component`` treats ``target``'s tensors, where that is known: "copy"
    (copies stored tensors into its own: a plain module, a tensor), "adopt" (keeps the
    stored tensors as they are: a plain torch optimizer, a dict), else None."""
    live = unwrap(target)
    if isinstance(live, torch.nn.Module):
        return "copy" if _plain_module(live) else None
    if isinstance(live, torch.optim.Optimizer):
        return "adopt" if _plain_optimizer(live) else None
    if type(live) in (torch.Tensor, torch.nn.Parameter):
        return "copy"
    if type(live) is dict:
        return "adopt"
    return None


def dtensor_lands_in_place(target: Any) -> str | None:
    """``lands_in_place`` for a target holding DTensors: "copy" for a plain or FSDP2
    module, "adopt" for a plain torch optimizer (loaded by parameter name through
    torch.distributed.checkpoint, which hands its tensors to ``load_state_dict``) or a
    dict, else None (a bare DTensor target among them: its tree has no path)."""
    live = unwrap(target)
    if isinstance(live, torch.nn.Module):
        return "copy" if _plain_module(live, fsdp2=True) else None
    if isinstance(live, torch.optim.Optimizer):
        return "adopt" if _plain_optimizer(live) else None
    if type(live) is dict:
        return "adopt"
    return None


class Taken:
    """The memory of the live tensors taken so far to land bytes in: a tensor whose bytes
    overlap one of them is not taken (it is read the usual way). Sorted per device."""

    def __init__(self) -> None:
        self._starts: dict[torch.device, list[int]] = {}
        self._ends: dict[torch.device, list[int]] = {}

    def take(self, tensor: torch.Tensor, nbytes: int) -> bool:
        """Take ``nbytes`` of ``tensor``'s memory from its first byte; False (nothing
        taken) if they overlap memory already taken."""
        lo = tensor.data_ptr()
        hi = lo + nbytes
        starts = self._starts.setdefault(tensor.device, [])
        ends = self._ends.setdefault(tensor.device, [])
        i = bisect.bisect_left(starts, lo)
        if (i < len(starts) and starts[i] < hi) or (i > 0 and ends[i - 1] > lo):
            return False
        starts.insert(i, lo)
        ends.insert(i, hi)
        return True
