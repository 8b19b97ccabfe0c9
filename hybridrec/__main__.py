"""``python -m hybridrec COMMAND ...``: the same as the ``hybridrec`` console command."""

from hybridrec.cli.commands import main

if __name__ == "__main__":
    main()
