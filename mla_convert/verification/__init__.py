"""`mla-convert verify`: prove a converted directory is complete, intact and numerically right.

Modules, in the order verify uses them:

- `api`: the entry point, `verify()`: opens the inputs and runs the passes below in turn.
- `structure`: the header pass (config, index, shard headers, tensor set, quantization_config),
  with `expects` (the tensors the directory must hold) and `mla_manifest` (mla/ and its headers).
- `tasks`: what the data pass of each file is to check, and what it returns; `runners` runs the
  tasks on threads or in worker processes.
- `data_pass`: one file read once, front to back: hashed, and each tensor checked from the same buffer
  (`buffers`) by its check groups: `values` (each value check declared once, torch and native forms
  side by side), `comparisons` (with --source: the comparison each transform names; torch forms in
  `against_source`, native ones in `native_pass`) and `mla` (the artifacts). `rows` reads tensors by offset, in row chunks; `readers` are the exact FP8 readers.
- `integrity`: the directory against its manifests and, with --source, that it is that source's
  conversion.
- `bounds` (the error bounds and their derivation), `report` (tallies and the report dict),
  `order` (which files go first).

This `__init__` imports no torch: the CLI reads the first files ahead while torch imports.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "verify":
        from mla_convert.verification.api import verify

        return verify
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
