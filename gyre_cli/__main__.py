import sys

from gyre_cli.main import main

sys.exit(main())
