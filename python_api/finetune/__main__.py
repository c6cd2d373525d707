"""`python -m elastic_kernels.api.finetune`: see python_api/finetune/__init__.py."""

from .cli import entry

if __name__ == "__main__":
    entry()
