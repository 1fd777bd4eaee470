import sys

from pipeline.config.load import main

sys.exit(main())
