"""`python -m services.decode`."""

import sys

from services.decode.main import main

sys.exit(main())
