"""``python -m advantage_server.demo DEMO [options]``, the same as ``advantage-demo``."""
import sys

from advantage_server.demo import main

sys.exit(main())
