import sys

from flashdraft.bench.cli import main

sys.exit(main())
