"""`python -m skiplock` is the `skiplock` command."""

import sys

from skiplock.scenarios.cli.main import main

sys.exit(main())
