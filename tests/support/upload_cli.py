"""The real CLI in this process, as `mla-convert ARGS...` runs it:

    python -m support.upload_cli ARGS...

tests/test_upload.py starts it (`start_upload`) in a child process, with the fake Hub's
environment, to send it real signals.
"""

from __future__ import annotations

import sys

from mla_convert.cli import main

if __name__ == "__main__":
    sys.argv = ["mla-convert", *sys.argv[1:]]
    main()
