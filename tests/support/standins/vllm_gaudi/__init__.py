"""Stand-in for vllm-gaudi (tests only; see ../README.md).

Each module follows the file of the same path in vllm-gaudi at PINNED_COMMIT, re-implemented in
plain torch where the real one calls Gaudi ops.
"""

PINNED_COMMIT = "091bbadda10bee4fd3f6d0efc1844d2610dd2707"  # vllm-project/vllm-gaudi main, 2026-08-21
