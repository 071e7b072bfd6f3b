"""``python -m quantkit.cli``: the `quantkit` command, as the console script runs it."""
from quantkit.cli import main

main()
