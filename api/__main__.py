"""`python -m purestep.api`: the `purestep` command."""

from .cli import main

if __name__ == "__main__":
    main()
