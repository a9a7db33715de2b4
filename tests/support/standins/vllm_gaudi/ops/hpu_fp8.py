"""Stand-in for vllm_gaudi/ops/hpu_fp8.py: the `Fp8LinearMethod` vllm-gaudi puts in place of
upstream's (`fp8.Fp8LinearMethod = Fp8LinearMethod`), for block-FP8 checkpoints."""

from __future__ import annotations

import torch
from vllm_upstream import Fp8LinearMethod as OrigFp8LinearMethod

import vllm_gaudi.extension.ops as hpu_ops
from vllm_gaudi import envs


class Fp8LinearMethod(OrigFp8LinearMethod):
    def create_weights(self, *args, **kwargs) -> None:
        if hpu_ops.is_hpu_gaudi2:
            kwargs["weight_loader"] = hpu_ops.gaudi_weight_wrapper(kwargs.get("weight_loader"))
        super().create_weights(*args, **kwargs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.quant_config = self.quant_config
        if not self.block_quant:
            raise NotImplementedError("stand-in: only block-FP8 checkpoints")
        hpu_ops.fp8_block_linear_postprocess_weights(layer, envs.VLLM_HPU_FORCE_CHANNEL_FP8)

    def dequant_fp8_weight(self, layer) -> torch.Tensor:
        if getattr(layer, "updated_fp8_weight", False):
            return layer.weight
        return hpu_ops.dequant_block_fp8_weight_naive(
            layer.weight, layer.weight_scale_inv.data, self.quant_config.weight_block_size,
            original_M=layer.orig_M, original_N=layer.orig_N, do_unpad=True,
        )  # fmt: skip
