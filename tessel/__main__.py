"""`python -m tessel ...`: the `tessel` command."""
import sys

from tessel.compiler.cli import main

sys.exit(main())
