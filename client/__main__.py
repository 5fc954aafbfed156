"""`python -m client`: the command-line client (client/__init__.py)."""

from client import main

raise SystemExit(main())
