"""`python -m workers.observe.doctor [--json]`."""

import sys

from rich.console import Console

from pipeline.settings import Settings
from workers.observe.doctor import doctor_command

sys.exit(doctor_command(Settings.load(), "--json" in sys.argv[1:], Console(soft_wrap=True)))
