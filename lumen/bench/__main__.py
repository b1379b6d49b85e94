import sys

from lumen.bench.cli import main

sys.exit(main())
