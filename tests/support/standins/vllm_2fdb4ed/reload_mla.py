"""Stand-in for vllm/model_executor/model_loader/reload/mla.py at vLLM 2fdb4ed (the whole module).

The processing policies do the weight work MLAAttention.process_weights_after_loading used to do
itself. `CommonMLAProcessingPolicy.process_weights` dequantizes kv_b_proj with the module-global
`get_and_maybe_dequant_weights`, splits it with its own `_split` (W_UK_T [N, P, L], W_UV [N, L, V],
both contiguous, not aliasing kv_b_proj) and stores them with `replace_parameter(...,
prefer_copy=True)`; `MLAReloadPolicy.finish` (trace-mode reload) recomputes them from a reloaded
kv_b_proj and copies them into the tensors bound after the cold load, without calling
process_weights_after_loading. Left out (NotImplementedError): the quantizations of the aiter
policy, the AMX packing kernel (`torch.ops._C.convert_weight_packed`) and the aiter BMM warm-up.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial

import torch
from vllm_upstream import get_and_maybe_dequant_weights

from .mla_attention import MLAAttention
from .reload_trace import ReloadError, ReloadState


class MLAProcessingPolicy:
    """Shared cold-load and reload processing contract for MLA layouts."""

    def process_weights(self, layer: MLAAttention, act_dtype: torch.dtype) -> None:
        raise NotImplementedError

    def warmup(self, layer: MLAAttention) -> None:
        pass

    def runtime_roles(self) -> tuple[str, ...]:
        raise NotImplementedError

    def bind_runtime(self, layer: MLAAttention, state: ReloadState) -> None:
        for role in self.runtime_roles():
            state.bind_target(role, partial(getattr, layer, role))

    def validate_runtime(self, layer: MLAAttention, state: ReloadState) -> None:
        for role in self.runtime_roles():
            if getattr(layer, role) is not state.targets[role].tensor:
                raise ReloadError(f"MLA {role} was replaced")

    def process_reload(self, layer: MLAAttention, weight: torch.Tensor, act_dtype: torch.dtype) -> dict:
        raise NotImplementedError


@dataclass
class CommonMLAProcessingPolicy(MLAProcessingPolicy):
    """Materialize the regular W_UK_T and W_UV MLA tensors."""

    dcp_q_replicate: bool = False

    def runtime_roles(self) -> tuple[str, ...]:
        roles: tuple[str, ...] = ("W_UK_T", "W_UV")
        if self.dcp_q_replicate:
            roles += ("W_UK_T_dcp_qrep",)
        return roles

    def _split(self, layer: MLAAttention, weight: torch.Tensor, act_dtype: torch.dtype):
        expected = (layer.kv_lora_rank, layer.num_heads * (layer.qk_nope_head_dim + layer.v_head_dim))
        weight = weight.to(act_dtype).T.contiguous()
        if tuple(weight.shape) != expected:
            raise ReloadError(f"MLA kv_b_proj weight has shape {tuple(weight.shape)}, expected {expected}")
        weight = weight.view(layer.kv_lora_rank, layer.num_heads, layer.qk_nope_head_dim + layer.v_head_dim)
        w_uk, w_uv = weight.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=-1)
        return w_uk.permute(1, 2, 0).contiguous(), w_uv.transpose(0, 1).contiguous()

    def process_reload(self, layer: MLAAttention, weight: torch.Tensor, act_dtype: torch.dtype) -> dict:
        w_uk_t, w_uv = self._split(layer, weight, act_dtype)
        values = {"W_UK_T": w_uk_t, "W_UV": w_uv}
        if self.dcp_q_replicate:
            from vllm_upstream import get_dcp_group  # vllm.distributed there

            values["W_UK_T_dcp_qrep"] = get_dcp_group().all_gather(w_uk_t.contiguous(), dim=0)
        return values

    def process_weights(self, layer: MLAAttention, act_dtype: torch.dtype) -> None:
        weight = get_and_maybe_dequant_weights(layer.kv_b_proj, out_dtype=act_dtype)
        values = self.process_reload(layer, weight, act_dtype)
        from vllm.model_executor.utils import replace_parameter

        replace_parameter(layer, "W_UK_T", values["W_UK_T"], prefer_copy=True)
        replace_parameter(layer, "W_UV", values["W_UV"], prefer_copy=True)
        if self.dcp_q_replicate:
            layer.W_UK_T_dcp_qrep = values["W_UK_T_dcp_qrep"]


@dataclass
class AiterMLAProcessingPolicy(CommonMLAProcessingPolicy):
    """Materialize AITER FP8/FP4 batched GEMM weights and scales (plain attributes)."""

    def runtime_roles(self) -> tuple[str, ...]:
        return ("W_K", "W_K_scale", "W_V", "W_V_scale")

    def process_weights(self, layer: MLAAttention, act_dtype: torch.dtype) -> None:
        weight = get_and_maybe_dequant_weights(layer.kv_b_proj, out_dtype=act_dtype)
        for name, value in self.process_reload(layer, weight, act_dtype).items():
            setattr(layer, name, value)

    def process_reload(self, layer: MLAAttention, weight: torch.Tensor, act_dtype: torch.dtype) -> dict:
        raise NotImplementedError("stand-in: the aiter MXFP4 / FP8 quantization")


@dataclass
class AMXMLAProcessingPolicy(MLAProcessingPolicy):
    """Replay the AMX MLA layout for reload: its roles are the impl's packed tensors."""

    def runtime_roles(self) -> tuple[str, ...]:
        return ("_w_uk_packed", "_w_uv_packed")

    def bind_runtime(self, layer: MLAAttention, state: ReloadState) -> None:
        state.bind_target("_w_uk_packed", partial(getattr, layer.impl, "_w_uk_packed"))
        state.bind_target("_w_uv_packed", partial(getattr, layer.impl, "_w_uv_packed"))

    def validate_runtime(self, layer: MLAAttention, state: ReloadState) -> None:
        for role in self.runtime_roles():
            if getattr(layer.impl, role) is not state.targets[role].tensor:
                raise ReloadError(f"AMX MLA {role} was replaced")

    def process_weights(self, layer: MLAAttention, act_dtype: torch.dtype) -> None:
        layer.impl.process_weights_after_loading(act_dtype)
        layer.kv_b_proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    def process_reload(self, layer: MLAAttention, weight: torch.Tensor, act_dtype: torch.dtype) -> dict:
        raise NotImplementedError("stand-in: torch.ops._C.convert_weight_packed")


def get_mla_processing_policy(layer: MLAAttention) -> MLAProcessingPolicy:
    if layer.is_amx_bmm_enabled:
        return AMXMLAProcessingPolicy()
    if layer.is_aiter_triton_fp8_bmm_enabled or layer.is_aiter_triton_fp4_bmm_enabled:
        return AiterMLAProcessingPolicy()
    return CommonMLAProcessingPolicy(dcp_q_replicate=layer.dcp_q_replicate)


@dataclass
class MLAReloadPolicy:
    """Reload common MLA runtime targets from kv_b_proj (trace-mode reload)."""

    attention: MLAAttention
    source: torch.nn.Module
    processing: MLAProcessingPolicy

    def destination(self, state: ReloadState, role: str, bound: inspect.BoundArguments) -> torch.Tensor:
        if not state.checkpoint:
            self.prepare_for_load(state)
        return state.checkpoint[role]

    def bind(self, state: ReloadState) -> None:
        layer = self.attention
        if not isinstance(layer, MLAAttention):
            raise TypeError(f"{state.key}: expected an MLAAttention module")
        if (
            layer.dcp_q_replicate or layer.W_UK_T_dcp_qrep is not None
        ) and "W_UK_T_dcp_qrep" not in self.processing.runtime_roles():
            raise NotImplementedError(f"{state.key}: MLA DCP query replication reload is unsupported")
        self.processing.bind_runtime(layer, state)

    def validate(self, state: ReloadState) -> None:
        self.processing.validate_runtime(self.attention, state)

    def prepare_for_load(self, state: ReloadState) -> None:
        pass

    def finish(self, state: ReloadState) -> None:
        self.validate(state)
        weight = get_and_maybe_dequant_weights(self.source, out_dtype=self.attention._mla_act_dtype)
        values = self.processing.process_reload(self.attention, weight, self.attention._mla_act_dtype)
        for role, value in values.items():
            state.copy_(role, value)
