"""`python -m purestep.api`: the `purestep` command."""

from .cli import main

main()
