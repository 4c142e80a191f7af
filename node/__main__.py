"""`python -m node` runs the intellect-node CLI."""

import sys

from node.cli import main

sys.exit(main())
