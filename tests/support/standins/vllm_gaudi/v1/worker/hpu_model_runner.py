"""Stand-in for vllm_gaudi/v1/worker/hpu_model_runner.py: what `HPUModelRunner.__init__` does to
the runtime config. A worker creates its model runner before it loads any weight, so whatever a
quantization config set on the runtime config earlier is gone by then."""

from vllm_gaudi.extension.runtime import clear_config, finalize_config


class HPUModelRunner:
    def __init__(self, vllm_config, device="hpu", is_driver_worker=False):
        clear_config()
        finalize_config()
        self.vllm_config = vllm_config
