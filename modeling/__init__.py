"""Torch-level code that more than one service uses: the drafter models (``eagle3``, ``dflash``, their attention
and fused kernels), the drafter's export formats (``export``, ``dflash_export``, ``export_method``), the target's
head (``target_head``), fp8 states (``fp8``), and small tensor helpers (``attention``, ``padding``, ``files``).
It imports the contracts (``shared``) and torch, never a service or the runtime."""
