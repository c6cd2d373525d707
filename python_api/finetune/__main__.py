"""`python -m python_api.finetune`: see python_api/finetune/__init__.py."""

from python_api.finetune.cli import entry

if __name__ == "__main__":
    entry()
