"""`python -m purestep`: the `purestep` command."""

from purestep.api.cli import main

if __name__ == "__main__":
    main()
