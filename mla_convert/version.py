"""The version of mla-convert, written into every manifest (a module of its own, so that no module
of the package imports the package's public face for it)."""

__version__ = "0.1.0"
