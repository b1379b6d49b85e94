import sys

from lumen.commands import run
from lumen.serve.cli import main

sys.exit(run(main))
