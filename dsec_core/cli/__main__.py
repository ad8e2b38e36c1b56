"""``python -m dsec_core.cli``: the ``dsec`` command."""

from . import main

main()
