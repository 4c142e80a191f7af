"""`python -m node` runs the intellect-node CLI."""

from node.cli import run

run()
