"""The output directory: what `--out` may be and what a run may replace there (`out_dir`), the
checks before the first byte (`preflight`), the conversion manifest (`manifest`), and the journal
that makes `--resume` possible (`journal`)."""
