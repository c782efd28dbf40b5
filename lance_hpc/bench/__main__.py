import sys

from lance_hpc.bench import main

sys.exit(main())
