import sys

from lumen.bench.cli import main
from lumen.commands import run

sys.exit(run(main))
