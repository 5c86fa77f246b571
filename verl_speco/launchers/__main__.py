"""`python -m verl_speco.launchers`: see verl_speco/launchers/cli.py."""

import sys

from verl_speco.launchers.cli import main

sys.exit(main())
