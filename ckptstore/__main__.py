"""`python -m ckptstore` runs the CLI."""

from ckptstore.cli import main

main()
