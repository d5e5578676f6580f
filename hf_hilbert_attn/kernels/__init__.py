"""Triton kernels of dilated attention: forward (out + lse), backward (dq, dk, dv), decoding.

Offers the launchers :func:`dilated_fwd` / :func:`dilated_bwd` (``ops.py``'s custom ops), the
runners :func:`fwd_runner` / :func:`bwd_runner` they run (kept by ``ops.py``'s prepared calls),
:func:`plan_positions` and the configuration (:func:`configure`, :func:`set_launch_hook`). Each
kernel's file holds it and its launch: ``_fwd.py`` the forward kernel, ``plan_fwd``,
``dilated_fwd``, ``fwd_runner``; ``_bwd.py`` the dq kernel and the backward's ``plan_bwd``,
``dilated_bwd``, ``bwd_runner`` (its dq launches, then those of ``_dkdv.py``'s dk/dv kernel, or
on Hopper with Triton 3.6 of ``_dkdv_wgmma.py``'s, in Gluon, where it covers the launch);
``_decode.py`` the decode kernel and its launcher. Shared: ``_common.py`` device helpers,
``_calls.py`` a call's host planning and the runners' setup, ``_plan.py`` position plans and tile
sizes, ``_config.py`` the configuration and the run step, ``_launch.py`` relaunches without
Triton's binding. Design: ``docs/kernels.md``. Imports neither transformers nor torch.distributed.
"""

from ._bwd import bwd_runner, dilated_bwd
from ._config import KernelConfig, configure, configured, kernel_config, set_launch_hook
from ._fwd import dilated_fwd, fwd_runner
from ._plan import PositionPlan, plan_positions

__all__ = ["dilated_fwd", "dilated_bwd", "fwd_runner", "bwd_runner", "plan_positions",
           "PositionPlan", "KernelConfig", "kernel_config", "configure", "configured",
           "set_launch_hook"]
