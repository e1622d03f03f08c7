"""``python -m leto_run`` is ``leto-run`` (for machines where the console script is absent)."""

from leto_run.cli import main

main()
