"""`python -m services.scheduler`."""

import sys

from services.scheduler.main import main

sys.exit(main())
