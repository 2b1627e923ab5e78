import sys

from dflash.bench.cli import main

sys.exit(main())
