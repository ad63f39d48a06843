"""`python -m workers.cli`."""

from workers.cli import main

main()
