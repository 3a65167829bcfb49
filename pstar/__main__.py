"""`python -m pstar`: the `pstar` command."""

from pstar.cli import main

main()
