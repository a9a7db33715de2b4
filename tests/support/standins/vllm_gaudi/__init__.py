"""Stand-in for vllm-gaudi (tests only; see tests/support/standins/README.md)."""
