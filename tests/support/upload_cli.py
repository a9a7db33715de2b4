"""The real CLI in this process, with commits of at most COMMIT_BYTES bytes, so that a tiny
checkpoint goes up in several commits (an interrupted upload then has some on the Hub already):

    python -m support.upload_cli COMMIT_BYTES ARGS...   # runs `mla-convert ARGS...`

It sets `mla_convert.publish.contents.COMMIT_BYTES`, which that module documents as the seam; the
product never reads it from its environment. tests/test_upload.py starts it (`start_upload`).
"""

from __future__ import annotations

import sys

from mla_convert.cli import main
from mla_convert.publish import contents

if __name__ == "__main__":
    contents.COMMIT_BYTES = int(sys.argv[1])
    sys.argv = ["mla-convert", *sys.argv[2:]]
    main()
