"""`python -m parallelkit.cli ...`: the `parallelkit` command (what torchrun and the tests launch)."""

from parallelkit.cli import main

if __name__ == "__main__":
    main()
