"""Error feedback: what compression dropped this step is added back before the next encode.

With a residual ``r`` per bucket, a rank sends ``y = x + r`` and keeps ``r' = y - (what the receivers
decoded on its behalf)``. Summed over ranks the compressed allreduce then returns
``z_t = sum_i x_i,t + R_t - R_{t+1}`` (``R`` the ranks' residuals summed), so over ``T`` steps
``sum_t z_t = sum_t sum_i x_i,t + R_0 - R_T``: the drift is one residual, bounded by one step's compression
error, not ``T`` of them (Seide et al. 2014 "1-bit SGD"; Karimireddy et al. 2019 "EF-SGD").
"""

from __future__ import annotations

from typing import Any, Hashable

import torch

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Per-bucket residuals, keyed by any hashable (a bucket index, a parameter name).

    A residual whose shape or dtype no longer matches the bucket (buckets were rebuilt) is dropped rather
    than misapplied.
    """

    __slots__ = ("_res",)

    def __init__(self) -> None:
        self._res: dict[Hashable, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._res)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._res

    def apply(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor + residual[key]`` as a new tensor (a plain copy when there is no matching residual).

        The sum is in the wider of the two dtypes (residuals are kept in the reduction dtype, float32).
        """
        r = self._res.get(key)
        x = tensor.detach()
        if r is None or r.shape != x.shape:
            return x.clone()
        if r.device != x.device:  # restored from a CPU checkpoint
            r = self._res[key] = r.to(x.device)
        return x.to(torch.promote_types(x.dtype, r.dtype)) + r

    def set(self, key: Hashable, residual: torch.Tensor) -> None:
        """Store the residual for ``key`` (kept in the dtype given, normally the reduction dtype)."""
        self._res[key] = residual.detach()

    def get(self, key: Hashable) -> torch.Tensor | None:
        return self._res.get(key)

    def norm(self) -> float:
        """L2 norm of all residuals together (how much compression error is in flight)."""
        return float(sum(float(r.double().pow(2).sum()) for r in self._res.values()) ** 0.5)

    def state_dict(self) -> dict[Hashable, torch.Tensor]:
        """Every residual (key -> tensor, on the CPU): part of a checkpoint, or a resumed run would drop one
        step's compression error and drift from the uninterrupted run."""
        return {k: r.cpu().clone() for k, r in self._res.items()}

    def load_state_dict(self, state: dict[Hashable, torch.Tensor]) -> None:
        self._res = {k: r.detach().clone() for k, r in state.items()}

    def reset(self, key: Any = None) -> None:
        """Forget one residual, or all when ``key`` is None."""
        if key is None:
            self._res.clear()
        else:
            self._res.pop(key, None)
