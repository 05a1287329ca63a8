"""`python -m prefixkv.server [serve options]`: the same as `prefixkv serve`."""

import sys

from prefixkv.server.cli import main

sys.exit(main())
