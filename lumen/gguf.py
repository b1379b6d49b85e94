"""`python -m lumen.gguf FILE`: a GGUF file's metadata and tensor table (the reader is lumen/format/gguf.py)."""
import sys

from lumen.format.gguf import main

if __name__ == "__main__":
    sys.exit(main())
