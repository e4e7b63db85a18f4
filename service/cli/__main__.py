"""``python -m service.cli``: the ``kato`` command."""

from kato.service.cli import main

main()
