"""``python -m cleave``: the ``cleave`` command."""

from cleave.cli.app import main

if __name__ == "__main__":
    main()
