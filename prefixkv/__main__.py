import sys

from prefixkv.cli import main

sys.exit(main())
