"""Stand-in for vllm 0.34.0's vllm/model_executor/layers/attention/mla_attention.py:
`split_kv_b_proj` (lines 416-431), what `MLAAttention.__init__` (452-800) adds for loading, and
`MLAAttention.process_weights_after_loading` (1428-1562); with the DCP manager's A2A combine of
vllm/v1/attention/ops/dcp.py (`MLADCPManager.__init__` / `_init_combine`).

Against 0.33.0: the hook takes no argument and reads `self.act_dtype`, which `__init__` sets from
the default dtype (vLLM builds the model under the model dtype); the default branch ends with
`W_UV_dcp`, an all-gather of W_UV over the DCP group, whenever DCP runs with more than one rank
and its A2A combine is on (`dcp_comm_backend == "a2a"`, no PCP). `split_kv_b_proj` is looked up
in this module at call time, as there. As in ../vllm_upstream.py, the ROCm aiter branches are left
out, and the default quant scales ask the quant config's `get_quant_method` (what
`resolve_quant_method` returns for the configs stood in).
"""

from __future__ import annotations

import torch
import vllm_upstream
from vllm_upstream import get_and_maybe_dequant_weights, set_default_quant_scales, should_load_quant_weights

from .utils import replace_parameter


class _DcpGroup:
    """`get_dcp_group()` of a DCP group of `world_size` ranks in which every rank holds what this one
    holds (the stand-in runs one rank): all_gather stacks `world_size` copies along `dim`."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return input_
        return torch.cat([input_] * self.world_size, dim=dim)


_DCP_WORLD_SIZE = 1  # set by the engine stand-in (tests/support/standins/mla_engine.py)


def get_dcp_group() -> _DcpGroup:
    return _DcpGroup(_DCP_WORLD_SIZE)


class MLADCPManager:
    """What the hook reads of vllm/v1/attention/ops/dcp.py's manager: its group and, with the A2A
    backend and no PCP, `v_up_proj_combine` (the combine that applies W_UV_dcp itself)."""

    def __init__(self, parallel_config, use_pcp: bool = False):
        self.group = get_dcp_group()
        self.use_a2a = getattr(parallel_config, "dcp_comm_backend", "ag_rs") == "a2a"
        self.v_up_proj_combine = "dcp_a2a_v_up_proj_lse_reduce" if self.use_a2a and not use_pcp else None


def split_kv_b_proj(kv_b_proj, out_dtype, kv_lora_rank, num_heads, qk_nope_head_dim, v_head_dim):
    """Dequantize kv_b_proj and return W_UK [L, N, P], W_UV [L, N, V] (views of its transpose)."""
    weight = get_and_maybe_dequant_weights(kv_b_proj, out_dtype=out_dtype).T
    assert weight.shape == (kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim)), tuple(weight.shape)
    weight = weight.view(kv_lora_rank, num_heads, qk_nope_head_dim + v_head_dim)
    return weight.split([qk_nope_head_dim, v_head_dim], dim=-1)


class MLAAttention(vllm_upstream.MLAAttention):
    def __init__(self, *args, vllm_config=None, **kwargs):
        super().__init__(*args, vllm_config=vllm_config, **kwargs)
        self.W_UV_dcp = None
        self.act_dtype = torch.get_default_dtype()
        self.dcp_manager = None
        if getattr(self.impl, "dcp_world_size", 1) > 1:
            self.dcp_manager = MLADCPManager(getattr(vllm_config, "parallel_config", None))

    def process_weights_after_loading(self) -> None:
        act_dtype = self.act_dtype
        self.impl.process_weights_after_loading(act_dtype)
        if self.is_amx_bmm_enabled:
            replace_parameter(self.kv_b_proj, "weight", self.kv_b_proj.weight.new_empty(0))
            return
        if self.dcp_q_replicate:
            assert self.q_pad_num_heads in (None, self.num_heads)
            if self.is_aiter_triton_fp4_bmm_enabled or self.is_aiter_triton_fp8_bmm_enabled:
                raise NotImplementedError(
                    "DCP query replication is not implemented for the aiter FP4/FP8 MLA BMM paths."
                )
        W_UK, W_UV = split_kv_b_proj(
            self.kv_b_proj, act_dtype, self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        )
        if self.is_aiter_triton_fp4_bmm_enabled or self.is_aiter_triton_fp8_bmm_enabled:
            raise NotImplementedError("stand-in: the ROCm aiter BMM branches")
        replace_parameter(self, "W_UV", W_UV.transpose(0, 1))  # (L, N, V) -> (N, L, V)
        replace_parameter(self, "W_UK_T", W_UK.permute(1, 2, 0))  # (L, N, P) -> (N, P, L)
        if self.dcp_q_replicate:
            replace_parameter(self, "W_UK_T_dcp_qrep", get_dcp_group().all_gather(self.W_UK_T.contiguous(), dim=0))
        if self.dcp_manager is not None and self.dcp_manager.v_up_proj_combine is not None:
            replace_parameter(self, "W_UV_dcp", get_dcp_group().all_gather(self.W_UV.contiguous(), dim=0))
        quant_method = self.quant_config.get_quant_method(self, prefix=self.layer_name) if self.quant_config else None
        if not should_load_quant_weights(quant_method):
            set_default_quant_scales(self, register_buffer=False)
