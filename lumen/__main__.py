import sys

from lumen.cli import main

sys.exit(main())
