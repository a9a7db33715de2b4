"""The arithmetic: its definition in eager torch (`numerics`), the native C kernels (`native`,
fp8_kernels.c), the probe set every implementation must pass (`probes`), the choice among them
(`select`), and bit-level equality (`bits`)."""
