"""``python -m pdctl`` is the ``pdctl`` command."""

from pdctl.cli import main

if __name__ == "__main__":
    main()
