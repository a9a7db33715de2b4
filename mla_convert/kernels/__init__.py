"""The arithmetic: the transforms, one module each (`transforms`: what each reads, its eager
definition, its C entry, its probes, verify's check), the arithmetic they share in eager torch
(`numerics`), the native C kernels (`native`, fp8_kernels.c), the probe inputs (`probes`), the one
chooser of an implementation (`fastest`, with `modes`: what --kernels tries, and `verdict`: a pass
remembered per machine), and bit-level equality (`bits`)."""
