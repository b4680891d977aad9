"""`python -m services.prefill`."""

import sys

from services.prefill.main import main

sys.exit(main())
