"""`python -m services.kvcache`."""

import sys

from services.kvcache.main import main

sys.exit(main())
