"""Stand-in for vllm-gaudi (tests only; see tests/standins/README.md)."""
