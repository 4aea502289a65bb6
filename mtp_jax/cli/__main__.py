"""`python -m mtp_jax.cli ...`: the `mtp-jax` command."""

import sys

from mtp_jax.cli import main

sys.exit(main())
