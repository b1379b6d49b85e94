"""`python -m lumen.models`: the model store's command line (the store itself is lumen/model/store.py)."""
import sys

from lumen.model.store import main

if __name__ == "__main__":
    sys.exit(main())
