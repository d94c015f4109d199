"""``python -m ignition.cli``: the ``ignition`` command."""

from ignition.cli import main

main()
