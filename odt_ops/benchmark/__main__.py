import sys

from odt_ops.benchmark.driver import main

sys.exit(main())
