"""`python -m mla_convert`: the command line, as `mla-convert` runs it (mla_convert.cli)."""

from mla_convert.cli.app import main

main()
