"""``python -m hybridrec COMMAND ...``: the same as the ``hybridrec`` console command."""

from hybridrec.commands import main

main()
