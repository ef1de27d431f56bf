"""The FSDP2 trainer-side API in one place: apply_fsdp2, the per-parameter policy and its patch.

`apply_fsdp2` lives in lab/fsdp.py (it needs the families and the torchrun runner); the policy and
the version-gated patch live in lab/precision/fsdp2_patch.py. This module gathers them under the
name the dtype-control spec uses.
"""

from __future__ import annotations

from lab.fsdp import apply_fsdp2
from lab.precision.fsdp2_patch import ParamDtypeMixedPrecisionPolicy, apply_param_dtype_map_patch

__all__ = ["ParamDtypeMixedPrecisionPolicy", "apply_fsdp2", "apply_param_dtype_map_patch"]
