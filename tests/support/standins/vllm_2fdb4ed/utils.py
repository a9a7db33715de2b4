"""Stand-in for vllm/model_executor/utils.py at vLLM 2fdb4ed: `replace_parameter`, with `prefer_copy`
(copy in place into an existing parameter of the same shape, dtype and device, strides unchecked;
else register a new parameter), as in 0.32.0 (see __init__.py for where this comes from)."""

from vllm_upstream import replace_parameter

__all__ = ["replace_parameter"]
