"""``python -m atropos.cli``: what the ``atropos-sandbox`` console script runs."""

from atropos.cli.main import main

main()
