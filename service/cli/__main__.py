"""``python -m service.cli``: the ``kato`` command."""

from service.cli import main

main()
