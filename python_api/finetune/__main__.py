"""`python -m python_api.finetune`: see python_api/finetune/__init__.py."""

import sys

from python_api.finetune.cli import main

if __name__ == "__main__":
    sys.exit(main())
