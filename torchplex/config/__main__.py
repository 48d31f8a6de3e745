"""`python -m torchplex.config ARGS`: check a config and exit (run_train.sh does, before torchrun starts)."""

from .loader import main

raise SystemExit(main())
