"""``python -m ignition``: the ``ignition`` command."""

from ignition.cli import main

main()
