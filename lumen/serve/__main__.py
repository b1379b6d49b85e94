import sys

from lumen.serve.cli import main

sys.exit(main())
