"""`python -m ckptstore` runs the CLI (through the launcher, as the `ckpt` command does)."""

from ckptstore.launch import main

main()
