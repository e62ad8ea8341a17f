"""`python -m kvrelay ...`: the same command line as `kvrelay ...`."""
import sys

from kvrelay.cli import main

sys.exit(main())
